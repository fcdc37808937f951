#!/usr/bin/env bash
# Source on the lent H200 in every call that carries a part of the vLLM pack (benchmarks/gpu/vllm_pack.sh
# made .carry/v0 .. .carry/vN on the CPU machine; carry one per call, back to back, in any order).
# Each call parks its part in /root/park-vllm. Once every part is there it reassembles the tar, checks
# its sha256, installs the wheels with `pip install --no-index --no-deps --target /tmp/vllm-site`
# (torch, transformers, ... stay the image's), and writes /tmp/vllm-python: python3 with
# /tmp/vllm-site first on PYTHONPATH, the interpreter eyas uses through EYAS_VLLM_PYTHON (eyas
# replaces PYTHONPATH for its vLLM children, so a bare PYTHONPATH would not reach them).
# Idempotent: later calls only export the environment. With VLLM_CHECK=1 it then runs
# benchmarks/gpu/vllm_check.py (import vllm + a tiny generation, each phase timed) under a hard
# timeout; its log and JSON go to $OUT/vllm-check.{log,json}. Off by default: it costs a cold engine
# start, and the eyas run after it starts its own (`../gpu_job.md`, session 36).
#
# Knobs: VLLM_CHECK=1 (run the check), CHECK_TIMEOUT_S (420; the `timeout` backstop is 30 s more),
# VLLM_ENABLE_V1_MULTIPROCESSING (unset = vLLM's default; 0 = engine core in-process),
# VLLM_HOST_IP (127.0.0.1 by default here), VLLM_LOGGING_LEVEL (INFO), CHECK_IMPORTS, CHECK_EAGER.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || return 1
_t0=$(date +%s.%N)
PARK=/root/park-vllm SITE=/tmp/vllm-site
mkdir -p "$PARK"
for d in .carry/v[0-9]*; do [ -d "$d" ] && cp -n "$d"/* "$PARK"/ 2>/dev/null; done
_n=$(sed -n 's/^parts=//p' "$PARK/MANIFEST" 2>/dev/null)
_have=$(ls "$PARK"/vllm-wheels.tar.part* 2>/dev/null | wc -l)
echo "vllm_setup: $_have of ${_n:-?} parts parked in $PARK"
if [ ! -f "$SITE/.done" ] && [ -n "$_n" ] && [ "$_have" -eq "$_n" ]; then
  _t=$(date +%s.%N)
  cat "$PARK"/vllm-wheels.tar.part* > /tmp/vllm-wheels.tar
  if [ "$(sha256sum /tmp/vllm-wheels.tar | cut -d' ' -f1)" != "$(sed -n 's/^sha256=//p' "$PARK/MANIFEST")" ]; then
    echo "vllm_setup: sha256 mismatch after reassembly; parts: $(ls "$PARK")" >&2
  else
    rm -rf /tmp/vllm-wheels && tar -C /tmp -xf /tmp/vllm-wheels.tar && mv /tmp/wheels /tmp/vllm-wheels
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        /tmp/vllm-wheels/*.whl > /tmp/vllm-install.log 2>&1; then
      touch "$SITE/.done"; rm -f /tmp/vllm-wheels.tar
      echo "vllm_setup: installed $(ls /tmp/vllm-wheels/*.whl | wc -l) wheels into $SITE in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $_t}") s"
    else
      echo "vllm_setup: pip install failed:"; tail -20 /tmp/vllm-install.log
    fi
  fi
fi
# the caches gpu_job.sh brings back (paths under /root: .cache/vllm/torch_compile_cache, .triton/cache)
bash benchmarks/gpu/compile_cache.sh restore .carry/vllm-cache/vllm-compile-cache.tgz /root
if [ -f "$SITE/.done" ]; then
  # children of the check dump their stacks on SIGUSR1 (the watchdog sends it on a timeout)
  mkdir -p /tmp/vllm-diag
  printf 'import faulthandler, signal\ntry:\n    faulthandler.register(signal.SIGUSR1, all_threads=True)\nexcept Exception:\n    pass\n' \
    > /tmp/vllm-diag/sitecustomize.py
  _py=$(command -v python3)
  printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec %s "$@"\n' "$SITE" "$_py" > /tmp/vllm-python
  chmod +x /tmp/vllm-python
  export EYAS_VLLM_PYTHON=/tmp/vllm-python
  export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1} VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  echo "vllm_setup: EYAS_VLLM_PYTHON=$EYAS_VLLM_PYTHON (python3 + $SITE), VLLM_HOST_IP=$VLLM_HOST_IP," \
       "VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-(vLLM default)}"
  if [ "${VLLM_CHECK:-0}" = 1 ] && [ ! -f /tmp/vllm-check.ok ]; then
    _log=${OUT:-/tmp}/vllm-check.log
    # in a process group of its own: the check ends by os._exit, and vLLM's engine core, its child,
    # outlived it holding its share of GPU memory, so the next engines did not fit (session 29)
    # (the group's id is the pid of the shell that setsid starts, forked or not)
    CHECK_JSON=${OUT:-/tmp}/vllm-check.json PYTHONPATH="$SITE:/tmp/vllm-diag" CHECK_T=$(( ${CHECK_TIMEOUT_S:-420} + 30 )) \
      setsid -w bash -c 'echo $$ > /tmp/vllm-check.pgid; exec timeout -k 10 "$CHECK_T" python3 benchmarks/gpu/vllm_check.py' \
      > "$_log" 2>&1
    _rc=$?
    bash "$(dirname "${BASH_SOURCE[0]}")/end_group.sh" "$(cat /tmp/vllm-check.pgid)" vllm_check
    grep -E '^CHECK (phase=|vllm|torch|generated|timeout|child)' "$_log"
    [ "$_rc" -eq 0 ] && touch /tmp/vllm-check.ok
    echo "vllm_setup: check exited $_rc (0 ok, 2 a phase failed, 3 watchdog timeout, 124/137 killed); log $_log"
  fi
elif [ -n "$_n" ] && [ "$_have" -eq "$_n" ]; then
  echo "vllm_setup: every part is here but the install failed (see above, /tmp/vllm-install.log)"
else
  echo "vllm_setup: vLLM not installed yet (carry the remaining .carry/v* parts)"
fi
echo "vllm_setup: $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $_t0}") s this call"
