#!/usr/bin/env bash
# The next train_bench series (benchmarks/train_bench.md, "Next"), in one device call on a machine
# where stage1.sh (carrying .carry/c0 and .carry/train) and stage2.sh have run. Offline features,
# 4 x 2,048-token packs, TTT 7, --compile: the whole-graph forward alone, with --fused-loss (and a
# profile), then FSDP2 on 2 GPUs when there are 2. Records: $OUT/s_*.json, .log, profile-*.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
export DATA=${DATA:-/root/data/regen}
common=(--modes offline --batch-sizes 4 --tokens-per-batch 2048 --steps 30 --warmup-steps 8 --compile 1
        --compile-scope model --max-samples 1500)
# the first run pays the whole-graph cold compile, never timed to the end before
BENCH_TIMEOUT_S=${FIRST_TIMEOUT_S:-300} NAME=s_model bash benchmarks/gpu/train_bench.sh "${common[@]}" | grep "tok/s"
BENCH_TIMEOUT_S=150 NAME=s_model_fused bash benchmarks/gpu/train_bench.sh "${common[@]}" --fused-loss --profile 5 \
  | grep "tok/s\|profiled"
# torchrun sets OMP_NUM_THREADS=1 and a plain process does not: the one difference in set-up
# between the 2-GPU DDP run (88k tokens/s per GPU) and the 1-GPU runs (49-51k) of 2026-11-30
OMP_NUM_THREADS=1 BENCH_TIMEOUT_S=120 NAME=s_model_fused_omp1 bash benchmarks/gpu/train_bench.sh "${common[@]}" \
  --fused-loss | grep "tok/s"
rm -f "$OUT/s_model_fused_omp1.log"  # a call returns at most 8 files; its line is printed above
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  NPROC=2 BENCH_TIMEOUT_S=200 NAME=s_fsdp2 bash benchmarks/gpu/train_bench.sh "${common[@]}" --parallel fsdp2 | grep "tok/s"
fi
