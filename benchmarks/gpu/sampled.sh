#!/usr/bin/env bash
# Issue 30's sampled regeneration, one call of it: all of ShareGPT regenerated at temperature 0.7
# (top-p 0.9, eyas prepare's defaults) by the pipeline, then 2,000 steps of the recipe (the step
# count of the masked greedy 120 s drafts on an H100, so that the pair holds steps equal across GPU
# kinds) and the MT-bench replay. Resumes; re-run until the pipeline says done.
# Usage (device): BUDGET_S=540 bash benchmarks/gpu/sampled.sh
# Since 2026-12-07 these answers are the ones in git (data/regenerated/, session 29's), which
# gpu_job.sh pipeline seeds the run with, so a call starts no vLLM; REGEN_SEED=none regenerates them
# anew (with the vLLM parts), each call returning the answers so far, a later call resuming after
# them with REGEN_SEED=DIR.
# Another training seed: TRAIN_SEED=1 BUDGET_S=300 bash benchmarks/gpu/sampled.sh trains in
# runs/smollm2-sampled-s1.
TRAIN_SEED=${TRAIN_SEED:-0}
W=runs/smollm2-sampled$([ "$TRAIN_SEED" = 0 ] || echo "-s$TRAIN_SEED")
export PIPE_SET="workdir=$W prepare.regenerate.temperature=0.7
train.budget=null train.max_steps=2000 train.seed=$TRAIN_SEED train.tau_every=null evaluate.engine=replay
evaluate.also_k=[3,7] evaluate.speed_concurrency=[]"
exec bash "$(dirname "$0")/gpu_job.sh" pipeline
