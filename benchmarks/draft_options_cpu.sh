#!/usr/bin/env bash
# Draft options at equal steps on the CPU (a small proxy for the GPU quality run). Real SmolLM2
# features, small draft vocab (2,048) and short packs so that 150 steps fit in minutes on 2 cores.
# Results: draft_options_cpu.md.
#   bash benchmarks/draft_options_cpu.sh REGENERATED_CONVERSATIONS.jsonl [WORK_DIR [NAME='TRAIN ARGS' ...]]
# Without NAME=ARGS runs it compares AdamW vs Muon, with and without fc_norm. Runs go two at a
# time, one thread each; a run whose metrics exist is not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
CONV=${1:?regenerated_conversations.jsonl from eyas prepare --regenerate}
W=${2:-/tmp/eyas-draft-options}
shift $(( $# < 2 ? $# : 2 ))
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=("adamw=" "muon=--optimizer muon" "adamw_fcnorm=--draft-config fc_norm=true"
                               "muon_fcnorm=--optimizer muon --draft-config fc_norm=true")
T=${TARGET:-smollm2-135m-instruct}
EYAS=${EYAS:-.venv/bin/eyas}
mkdir -p "$W"
[ -f "$W/prep/manifest.json" ] || OMP_NUM_THREADS=2 $EYAS prepare --target $T --data "$CONV" --max-samples 500 \
  --max-length 1024 --draft-vocab-size 2048 --out "$W/prep" --quiet
OMP_NUM_THREADS=2 $EYAS extract --target $T --data "$W/prep" --out "$W/store" --device cpu
run() {
  local name=$1; shift
  [ -s "$W/$name/summary.json" ] && return 0
  rm -rf "$W/$name"
  OMP_NUM_THREADS=1 $EYAS train --target $T --data "$W/prep" --features offline --store "$W/store" --out "$W/$name" --device cpu \
    --ttt-steps 3 --tokens-per-batch 1024 --max-steps 150 --lr 1e-3 --warmup 15 --eval-every 50 \
    --eval-batches 8 --heldout 0.05 --save-every 0 --experimental "$@" > "$W/$name.log" 2>&1
}
# two at a time, one thread each ($@ word-splits each run's args on purpose)
for ((i = 0; i < ${#RUNS[@]}; i += 2)); do
  for r in "${RUNS[@]:i:2}"; do
    run "${r%%=*}" ${r#*=} &
  done
  wait
done
for r in "${RUNS[@]}"; do
  python3 - "$W/${r%%=*}/metrics.jsonl" "${r%%=*}" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for d in (r for r in recs if r["split"] == "heldout"):
    print(sys.argv[2], "step", d["step"], "top-1 per TTT step", [round(a, 3) for a in d["acc"]],
          "mean CE", round(sum(d["loss"]) / len(d["loss"]), 3), "positions", int(d["positions"][0]))
PY
done
