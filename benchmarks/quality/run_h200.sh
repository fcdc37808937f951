#!/usr/bin/env bash
# The quality comparison (eyas vs speculators==0.9.0 + ablations) on the lent 2x H200, in two
# device calls: `run_h200.sh main` then, while the machine is warm, `run_h200.sh rest`.
# Needs the target from benchmarks/gpu/stage1.sh + stage2.sh, the conversations in /root/q
# (regenerated_conversations.jsonl + original_conversations.jsonl, carried in .carry/q0 by the
# stage1 call) and, for `main`, .carry/quality/whl carried (speculators 0.9.0 and its wheels).
# Extra arguments go to run_quality.py (e.g. --main-budget-s 180).
set -eo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
PHASE=${1:?usage: run_h200.sh main|rest [run_quality.py flags]}; shift
: "${OUT:?OUT must be set (the result folder of the device call)}"
if [ -z "${EYAS_GPU_TARGET:-}" ]; then  # a call after the stage2 call: reuse what it left
  [ -s /root/m/target_path ] && [ -d /tmp/site ] || { echo "no converted target on this machine: run stage1 + stage2 first"; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 EYAS_CACHE=/root/eyas-cache
  export EYAS_GPU_TARGET=$(cat /root/m/target_path)
fi
[ -d "$EYAS_GPU_TARGET" ] || { echo "target dir $EYAS_GPU_TARGET missing"; exit 3; }
if [ ! -d /tmp/site-q ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-q .carry/quality/whl/*.whl
fi
export PYTHONPATH=/tmp/site-q:$PYTHONPATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import speculators, datasets, torch; import importlib.metadata as md; print('speculators', md.version('speculators'), 'datasets', datasets.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
W=/tmp/quality; mkdir -p $W
# leave ~25 s of the 600 s call for packing results
DEADLINE=${DEADLINE:-$((575 - SECONDS + START - ${ALREADY_USED_S:-0}))}
set +e
python3 benchmarks/quality/run_quality.py --phase $PHASE --target "$EYAS_GPU_TARGET" \
  --regenerated /root/q/regenerated_conversations.jsonl --original /root/q/original_conversations.jsonl \
  --prompts data/mt_bench/question.jsonl --work $W --out $OUT --deadline-s $DEADLINE --gpus $GPUS \
  --python python3 --spec-python python3 "$@" 2>&1 | tee $OUT/run-$PHASE.log
rc=${PIPESTATUS[0]}
tar czf $OUT/logs-$PHASE.tgz -C $W logs $(cd $W && ls -d eyas_main/metrics.jsonl spec_main/spec_train.json eval_*/builtin/report.json abl_*/metrics.jsonl 2>/dev/null) 2>/dev/null
ls -la $OUT
exit $rc
