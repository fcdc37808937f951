#!/bin/bash
# Issue 31's Qwen batch (README, "The next session's calls") in a command short enough that
# the twenty calls after the first go out within the machine's 30 s of idle time.
# Q_SET adds pipeline settings, e.g. Q_SET="evaluate.speed_concurrency=[1,32]".
source benchmarks/gpu/use_snapshot.sh
export PIPE_CONFIG=configs/qwen0.5b-h200.yaml
export PIPE_SET="train.budget=5m train.save_every=500 train.tau=false train.tau_every=null evaluate.k=3 evaluate.also_k=[4,2,1,5] ${Q_SET:-}"
exec bash benchmarks/gpu/gpu_job.sh "$@"
