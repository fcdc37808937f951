#!/usr/bin/env bash
# Copy what `eyas pipeline` needs to go on with a run elsewhere into STAGE (made anew): the stage
# records (pipeline-config.json, pipeline-timings.json) and
#   - train/ with only its newest checkpoint, without the draft: the training resumes there;
#   - with `draft`: train/ with the finished draft and no checkpoint, and eval/ as far as it got:
#     the pipeline skips training, exports again (a second) and resumes the evaluation (the k done
#     start no engine).
# The prepared data is not copied: the answers are seeded from git and prepare makes the same dataset
# again. Used by `gpu_job.sh home` (HOME_WHAT=draft for the second) before send_home.sh.
#
#   bash benchmarks/gpu/stage_run.sh WORKDIR STAGE [draft]
set -euo pipefail
W=${1:?usage: stage_run.sh WORKDIR STAGE [draft]} S=${2:?stage dir} WHAT=${3:-checkpoint}
case $WHAT in
  checkpoint)
    last=$(ls -d "$W"/train/checkpoints/step-* 2>/dev/null | tail -1 || true)
    [ -n "$last" ] || { echo "stage_run: no checkpoint in $W/train/checkpoints: nothing to resume from" >&2; exit 1; } ;;
  draft)
    [ -s "$W/train/draft/model.safetensors" ] || { echo "stage_run: no finished draft in $W/train/draft" >&2; exit 1; } ;;
  *) echo "stage_run: WHAT is checkpoint or draft, not $WHAT" >&2; exit 2 ;;
esac
rm -rf "$S" && mkdir -p "$S/train"
cp "$W"/pipeline-config.json "$S"/
[ -f "$W"/pipeline-timings.json ] && cp "$W"/pipeline-timings.json "$S"/
if [ "$WHAT" = checkpoint ]; then
  tar -C "$W" -cf - --exclude=train/draft --exclude=train/checkpoints train | tar -C "$S" -xf -
  mkdir -p "$S/train/checkpoints" && cp -r "$last" "$S/train/checkpoints/"
  echo "stage_run: $W -> $S ($(du -sh "$S" | cut -f1), checkpoint $(basename "$last"))"
else
  # shellcheck disable=SC2046  # eval/ where the evaluation began
  tar -C "$W" -cf - --exclude=train/checkpoints --exclude=draft-vllm train $(cd "$W" && ls -d eval 2>/dev/null) \
    | tar -C "$S" -xf -
  echo "stage_run: $W -> $S ($(du -sh "$S" | cut -f1), the draft$( [ -d "$S/eval" ] && echo " and the evaluation so far"))"
fi
