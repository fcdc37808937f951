#!/usr/bin/env bash
# Issue 30's recipe sweep on the lent H200 (benchmarks/recipe/sweep.py), one device call at a time:
#
#   bash benchmarks/gpu/recipe.sh        (BUDGET_S: this call's seconds, from its start, default 540)
#
# Every call sources use_snapshot.sh (the code of one commit for the whole series) and setup.sh (the
# carried parts); a call that finds a part missing only parks what it carried. The sweep resumes over
# calls: its runs and the shared reference answers stay in /root/recipe on the warm machine, and
# every call brings back results.jsonl and the runs' small files (recipe.tgz).
# Settings: CONFIGS (default benchmarks/recipe/sweep1.json), TRAIN_BUDGET (seconds of steps per
# training, 120), PREP (the prepared data, default the carried prep-regen), ONLY (names), SAVE_EVERY
# (steps between checkpoints: a training longer than one call is stopped at the deadline and resumed
# by the next call on the same warm machine).
set -uo pipefail
source "$(dirname "$0")/budget.sh"  # first: BUDGET_S counts from here, setup's time comes off the sweep's
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the console without progress bars (all of it in log.txt): see gpu_job.sh
exec > >(tee -a "$OUT/log.txt" | tr '\r' '\n' | grep --line-buffered -v -E '%\||\[[0-9]{2}:[0-9]{2}[<,]') 2>&1
source benchmarks/gpu/use_snapshot.sh  # first: eyas is installed from this code
source benchmarks/gpu/setup.sh
cd "$(dirname "$0")/../.." 2>/dev/null || true
PREP=${PREP:-/root/park/prep-regen} R=/root/recipe
GGUF=$EYAS_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$PREP/manifest.json" ] || [ ! -s "$GGUF" ] || [ ! -f /tmp/site/.done ]; then
  echo "recipe: parts missing (prepared $PREP, target, gguf package): parked what this call carried"; exit 0
fi
COMMIT=$(cat /root/snap/COMMIT 2>/dev/null || echo "${EYAS_COMMIT:-?}")
IFS=, read -r GPU MEM < <(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader)  # the kind that came
echo "recipe: eyas $COMMIT; $GPU,$MEM"
B=$(budget 540)
timeout -s INT -k 20 "$B" python3 benchmarks/recipe/sweep.py --mirror "$OUT/results.jsonl" --data "$PREP" --runs "$R" --results "$R/results.jsonl" \
  --configs "${CONFIGS:-benchmarks/recipe/sweep1.json}" --budget "${TRAIN_BUDGET:-120}" \
  --deadline-s "$B" ${ONLY:+--only "$ONLY"} ${SAVE_EVERY:+--save-every "$SAVE_EVERY"} --commit "$COMMIT" --machine "1x ${GPU:-GPU} (lent)" \
  --common "--tokens-per-batch 2048 --warmup 50 --device cuda --precision bf16 --save-every 0 --eval-every 0" \
  --evaluate "--device cuda --dtype bfloat16 --batch-size 256" --tau-every "${TAU_EVERY:-60s}"
cp "$R/results.jsonl" "$OUT/all-results.jsonl" 2>/dev/null
( cd "$R" && tar -czf "$OUT/recipe.tgz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='records.jsonl' \
    --exclude='references*' --exclude='tensorboard' --exclude='draft-vllm' . 2>/dev/null )
ls -la "$OUT"
