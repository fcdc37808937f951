#!/usr/bin/env bash
# A quality comparison (run_quality.py's WORK) made ready to go on in a later session, as
# stage_run.sh does for a pipeline run:
#
#   bash benchmarks/gpu/stage_quality.sh WORK STAGE    # copy into STAGE (made anew)
#   bash benchmarks/gpu/stage_quality.sh WORK --list   # the small results, NUL-separated, relative to WORK
#
# The small results are what gpu_job.sh's quality.tgz holds: every evaluation's report (with its turns,
# for pairing), the runs' records and the target's answers (references*.jsonl, so that the later
# session replays on the same answers). STAGE adds results.json (the state the next main call
# continues) and the runs' states:
#   - speculators (spec_main/): spec_train.json, and the numbered checkpoint its stop made, which
#     `--spec-resume` continues; a finished run needs nothing more (its reports are staged);
#   - eyas (eyas_main/): its records and metrics, and its newest checkpoint where it did not finish,
#     which the next main call resumes.
# Not staged: the data and stores (the next main call makes them again from the same seeded
# conversations) and the kept saves (their points of the curve are evaluated, their reports staged).
# Used by `gpu_job.sh home` with HOME_WHAT=quality before send_home.sh.
set -euo pipefail
W=${1:?usage: stage_quality.sh WORK STAGE|--list}
S=${2:?usage: stage_quality.sh WORK STAGE|--list}
list() {
  (cd "$W" && find . \( -name report.json -o -name spec_train.json -o -name summary.json \
    -o -name metrics.jsonl -o -name eyas_conversion.json -o -name manifest.json -o -name '*.log' \
    -o -path './references*.jsonl' \) \
    -not -path './store_*' -not -path './spec_data/hidden_states/*' -print0)
}
if [ "$S" = --list ]; then list; exit 0; fi
[ -s "$W/results.json" ] || { echo "stage_quality: no $W/results.json: no comparison to carry on" >&2; exit 1; }
rm -rf "$S" && mkdir -p "$S"
# without the data's records: the next main call takes a prepared set or a store with its manifest for
# a complete one, so they are made again whole, records included
list | { grep -z -v -E '^\./(prep_|store_|spec_data/)' || true; } | tar -C "$W" --null -T - -cf - | tar -C "$S" -xf -
cp "$W/results.json" "$S/"
what=()
sj=$W/spec_main/spec_train.json
if [ -s "$sj" ]; then
  ck=$(python3 -c 'import json, sys; print((json.load(open(sys.argv[1])).get("stopped") or {}).get("checkpoint") or "")' "$sj")
  if [ -n "$ck" ]; then
    [ -f "$ck/training_state.json" ] || { echo "stage_quality: speculators stopped at $ck, which holds no training_state.json" >&2; exit 1; }
    rel=${ck#"$W"/}
    mkdir -p "$S/$(dirname "$rel")" && cp -r "$ck" "$S/$rel"
    what+=("speculators' checkpoint $rel")
  else
    what+=("speculators finished")
  fi
fi
if [ -d "$W/eyas_main" ]; then
  tar -C "$W" -cf - --exclude=eyas_main/draft --exclude=eyas_main/checkpoints eyas_main | tar -C "$S" -xf -
  if [ -s "$W/eyas_main/draft/model.safetensors" ]; then
    what+=("eyas finished")
  else
    # the newest complete one, as eyas's resume picks it
    last=$(python3 -c 'import sys; from eyas.train.checkpoint import checkpoint_dirs as c; d = c(sys.argv[1]); print(d[-1] if d else "")' "$W/eyas_main")
    if [ -n "$last" ]; then
      mkdir -p "$S/eyas_main/checkpoints" && cp -r "$last" "$S/eyas_main/checkpoints/"
      what+=("eyas's checkpoint $(basename "$last")")
    else  # failed before its first checkpoint: the next main call trains it afresh
      what+=("eyas with no checkpoint (to start afresh)")
    fi
  fi
fi
echo "stage_quality: $W -> $S ($(du -sh "$S" | cut -f1); $(IFS=,; echo "${what[*]:-no run}"))"
