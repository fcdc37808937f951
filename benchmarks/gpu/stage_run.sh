#!/usr/bin/env bash
# Copy what `eyas pipeline` needs to resume a run's training elsewhere into STAGE (made anew): the
# stage records (pipeline-config.json, pipeline-timings.json) and train/ with only its newest
# checkpoint, without the draft. The prepared data is not copied: the answers are seeded from git and
# prepare makes the same dataset again. Used by `gpu_job.sh home` before send_home.sh.
#
#   bash benchmarks/gpu/stage_run.sh WORKDIR STAGE
set -euo pipefail
W=${1:?usage: stage_run.sh WORKDIR STAGE} S=${2:?stage dir}
last=$(ls -d "$W"/train/checkpoints/step-* 2>/dev/null | tail -1 || true)
[ -n "$last" ] || { echo "stage_run: no checkpoint in $W/train/checkpoints: nothing to resume from" >&2; exit 1; }
rm -rf "$S" && mkdir -p "$S/train/checkpoints"
cp "$W"/pipeline-config.json "$S"/
[ -f "$W"/pipeline-timings.json ] && cp "$W"/pipeline-timings.json "$S"/
tar -C "$W" -cf - --exclude=train/draft --exclude=train/checkpoints train | tar -C "$S" -xf -
cp -r "$last" "$S/train/checkpoints/"
echo "stage_run: $W -> $S ($(du -sh "$S" | cut -f1), checkpoint $(basename "$last"))"
