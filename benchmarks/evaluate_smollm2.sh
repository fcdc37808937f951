#!/usr/bin/env bash
# The committed SmolLM2-135M-Instruct evaluation (reports/smollm2-135m-instruct/), on CPU:
# prepare a ShareGPT slice, train a draft for a few minutes, evaluate it with both engines.
# Results and the machine they ran on: benchmarks/evaluate_results.md.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${W:-runs/smol}
eyas prepare --out "$W/data" --data sharegpt --max-samples 3000 --max-length 1024 --draft-vocab-size 8000
# One thread: on a shared 2-core machine torch's default 2 threads ran 10-20x slower (contention).
OMP_NUM_THREADS=1 eyas train --online --data "$W/data" --out "$W/run2" --max-steps 120 --ttt-steps 3 \
    --tokens-per-batch 1024 --lr 2e-3 --warmup 10 --save-every 40 --eval-every 0 --eval-batches 4
DRAFT=${DRAFT:-$W/run2/draft}
OMP_NUM_THREADS=1 eyas evaluate --target smollm2-135m-instruct --draft "$DRAFT" --engine both \
    --max-per-category 1 --max-new-tokens 64 -k 3 --out "$W/eval2"
mkdir -p reports/smollm2-135m-instruct
cp "$W"/eval2/comparison.json "$W"/eval2/*.png reports/smollm2-135m-instruct/
for e in builtin vllm; do
  mkdir -p reports/smollm2-135m-instruct/$e
  cp "$W"/eval2/$e/report.json "$W"/eval2/$e/*.png reports/smollm2-135m-instruct/$e/
done
