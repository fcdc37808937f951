#!/usr/bin/env bash
# train_bench.py on the warm device machine, in a call after stage2.sh (or after the quality
# benchmark's calls): the converted target and gguf's site dir are already there. Data: DATA (a
# prepared dataset on that machine; default the quality run's regenerated set). Arguments go to
# train_bench.py; the record lands in $OUT/train_bench.json (+ profile-*.txt with --profile).
set -eo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the result folder of the device call)}"
[ -s /root/m/target_path ] || { echo "no converted target on this machine: run stage1 + stage2 first"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache
DATA=${DATA:-/tmp/quality/prep_regen}
[ -d "$DATA" ] || { echo "prepared dataset $DATA missing (set DATA)"; exit 3; }
timeout "${BENCH_TIMEOUT_S:-540}" python3 benchmarks/train_bench.py --target "$(cat /root/m/target_path)" \
  --data "$DATA" --work /dev/shm/eyas-tb --json "$OUT/train_bench.json" "$@" 2>&1 | tee "$OUT/train_bench.log"
