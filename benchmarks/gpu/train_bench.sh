#!/usr/bin/env bash
# train_bench.py on the warm device machine, in a call after stage2.sh (or after the quality
# benchmark's calls): the converted target and gguf's site dir are already there. Data: DATA (a
# prepared dataset on that machine; default the quality run's regenerated set). Arguments go to
# train_bench.py; the record lands in $OUT/$NAME.json (NAME default train_bench; + profile-*.txt
# with --profile; RESULTS=DIR writes them there instead). NPROC=N runs it under torchrun on N GPUs
# (with --parallel ddp|fsdp2). WORK: its scratch folder (default /dev/shm/eyas-tb; give concurrent
# runs their own).
set -eo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the result folder of the device call)}"
[ -s /root/m/target_path ] || { echo "no converted target on this machine: run stage1 + stage2 first"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache
DATA=${DATA:-/tmp/quality/prep_regen}
[ -d "$DATA" ] || { echo "prepared dataset $DATA missing (set DATA)"; exit 3; }
NAME=${NAME:-train_bench}
RESULTS=${RESULTS:-$OUT}
mkdir -p "$RESULTS"
LAUNCH=(python3)
if [ -n "${NPROC:-}" ]; then
  LAUNCH=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md
fi
timeout "${BENCH_TIMEOUT_S:-540}" "${LAUNCH[@]}" benchmarks/train_bench.py --target "$(cat /root/m/target_path)" \
  --data "$DATA" --work "${WORK:-/dev/shm/eyas-tb}" --json "$RESULTS/$NAME.json" "$@" 2>&1 | tee "$RESULTS/$NAME.log"
