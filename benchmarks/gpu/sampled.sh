#!/usr/bin/env bash
# Issue 30's sampled regeneration, one call of it: all of ShareGPT regenerated at temperature 0.7
# (top-p 0.9, eyas prepare's defaults) by the pipeline, nothing seeded from git so the answers come
# back, then 2,000 steps of the recipe (the step count of the masked greedy 120 s drafts on an H100,
# so that the pair holds steps equal across GPU kinds) and the MT-bench replay. Resumes; re-run
# until the pipeline says done. Usage (device): BUDGET_S=540 bash benchmarks/gpu/sampled.sh
# Every call returns the answers so far; a later session resumes after them with REGEN_SEED=DIR
# (their regenerated.jsonl.xz and regenerate.json).
export REGEN_SEED=${REGEN_SEED:-none} REGEN_BACK=1 PIPE_SET="workdir=runs/smollm2-sampled prepare.regenerate.temperature=0.7
train.budget=null train.max_steps=2000 train.tau_every=null evaluate.engine=replay evaluate.also_k=[3,7]
evaluate.speed_concurrency=[]"
exec bash "$(dirname "$0")/gpu_job.sh" pipeline
