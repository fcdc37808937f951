#!/usr/bin/env bash
# One device call's train_bench series on a 2-GPU machine where stage1.sh (carrying .carry/c0 and
# .carry/train) and stage2.sh have run: two lanes at once, one per GPU, each a few train_bench.sh
# runs in a row (each run extracts its own store first; compiled kernels are shared through the
# machine's inductor cache). Offline features from the carried set (DATA), 2,048-token packs, TTT 7,
# --compile (whole-graph scope). SERIES picks the lanes:
#   single (default): lane 0 the default loss, lane 1 --fused-loss (+ a profile); each at 16 and 4
#                     packs per micro-batch, then at 16 with CUDA graphs (--compile-mode reduce-overhead);
#   multi:            2 GPUs together: FSDP2 (default loss) and DDP (--fused-loss) at 16 packs;
#   after:            (after the copy stream and the compiled target statistics) lane 0 the fused loss
#                     offline at 16 packs (+ a profile), then at 4; lane 1 the CUDA-only tests of
#                     training, then the fused loss online at 16 packs;
#   ddp:              2 GPUs together: DDP with --fused-loss at 16 packs.
# Every record lands in $OUT/series.tgz (a call returns at most 8 files); lines with tok/s are printed.
set -o pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the result folder of the device call)}"
export DATA=${DATA:-/root/data/regen} RESULTS=$OUT/series
mkdir -p "$RESULTS"
common=(--modes offline --tokens-per-batch 2048 --steps 30 --warmup-steps 8 --compile 1 --compile-scope model)
budget=${SERIES_TIMEOUT_S:-540}  # the whole series, so that the records are packed before the call's limit

run() {  # NAME TIMEOUT_S ARGS...: one train_bench.sh run; its result lines are printed with the name
  local name=$1 tmo=$2
  shift 2
  BENCH_TIMEOUT_S=$tmo NAME=$name bash benchmarks/gpu/train_bench.sh "${common[@]}" "$@" \
    | grep "tok/s\|profiled\|FAILED\|Error" | sed "s/^/[$name] /"
}

lane0() {
  export CUDA_VISIBLE_DEVICES=0 WORK=/dev/shm/tb0
  run a 300 --batch-sizes 16,4
  run a_ro 180 --batch-sizes 16 --compile-mode reduce-overhead
}

lane1() {
  export CUDA_VISIBLE_DEVICES=1 WORK=/dev/shm/tb1
  run f 300 --batch-sizes 16,4 --fused-loss --loss-chunk 16384 --profile 5
  run f_ro 180 --batch-sizes 16 --fused-loss --loss-chunk 16384 --compile-mode reduce-overhead
}

multi() {
  export WORK=/dev/shm/tbm
  NPROC=2 run m_fsdp2 260 --batch-sizes 16 --parallel fsdp2
  NPROC=2 run m_ddp_f 200 --batch-sizes 16 --parallel ddp --fused-loss --loss-chunk 16384
}

after0() {
  export CUDA_VISIBLE_DEVICES=0 WORK=/dev/shm/tb0
  run o 260 --batch-sizes 16 --fused-loss --loss-chunk 16384 --profile 5
  run o4 170 --batch-sizes 4 --fused-loss --loss-chunk 16384
}

after1() {
  export CUDA_VISIBLE_DEVICES=1 WORK=/dev/shm/tb1
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_train_run.py -k "side_stream" 2>&1 | tail -3 \
    | sed "s/^/[pytest] /"
  run n 300 --batch-sizes 16 --fused-loss --loss-chunk 16384 --modes online
}

ddp() {
  export WORK=/dev/shm/tbm
  NPROC=2 run m_ddp_f 270 --batch-sizes 16 --parallel ddp --fused-loss --loss-chunk 16384
}

export -f run lane0 lane1 multi after0 after1 ddp
export common_s="${common[*]}"
if [ "${SERIES:-single}" = multi ] || [ "${SERIES:-single}" = ddp ]; then
  timeout "$budget" bash -c "common=(\$common_s); $SERIES"
elif [ "${SERIES:-single}" = after ]; then
  timeout "$budget" bash -c 'common=($common_s); after0' &
  timeout "$budget" bash -c 'common=($common_s); after1' &
  wait
else
  timeout "$budget" bash -c 'common=($common_s); lane0' &
  timeout "$budget" bash -c 'common=($common_s); lane1' &
  wait
fi
tar -czf "$OUT/series.tgz" -C "$OUT" series && rm -rf "$RESULTS"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
