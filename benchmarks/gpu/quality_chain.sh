#!/usr/bin/env bash
# Issue 32's four phases (gpu_job.sh quality) one after another in one job, to be started by
# detach.sh and followed by watch.sh calls:
#
#   source benchmarks/gpu/use_snapshot.sh && Q_BUDGET_S=300 Q_EVERY_S=60 CHAIN_S=1400 \
#     bash benchmarks/gpu/detach.sh q bash benchmarks/gpu/quality_chain.sh
#
# The data (QTRAIN= : the store and speculators' copy), speculators' run, eyas's run, the rest (the
# replays and the pairs), each with its own BUDGET_S and OUT/<phase>. CHAIN_S caps the whole chain:
# a phase gets at most what is left of it, and none starts with under 60 s. A failed data phase ends
# the chain (the trainers need its store); a failed trainer does not (the rest phase evaluates what
# exists). Q_TRAINERS (default "speculators eyas") picks the trainers: one a session where the device
# time holds one run only; the rest phase evaluates the runs there are, and pair_runs.py pairs two
# sessions' runs here.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
ROOT=${OUT:?OUT: where the phases write (detach.sh sets it)}
phase() {  # phase NAME BUDGET_S QPHASE [QTRAIN] (without it, gpu_job.sh's default: both trainers)
  local left=$(( ${CHAIN_S:-1400} - ($(date +%s) - T0) )) b=$2
  (( b > left )) && b=$left
  if (( b < 60 )); then echo "chain: $1 not started, $left s of CHAIN_S left"; return 1; fi
  echo "chain: $1 for $b s at $(date +%T)"
  if [ $# -ge 4 ]; then export QTRAIN=$4; else unset QTRAIN; fi
  OUT=$ROOT/$1 QPHASE=$3 BUDGET_S=$b bash benchmarks/gpu/gpu_job.sh quality
  local rc=$?
  echo "chain: $1 ended with status $rc at $(date +%T)"
  return $rc
}
# speculators' phase: its probe (whose first step compiles, a minute or two on an H100), its run's
# own first step, Q_BUDGET_S of steps and its saves (../gpu_job.md, session 21)
budget_of() {  # a trainer's phase budget; fails for a name that is no trainer
  case $1 in speculators) echo "${Q_SPEC_S:-700}" ;; eyas) echo "${Q_EYAS_S:-500}" ;; *) return 1 ;; esac
}
TRAINERS=${Q_TRAINERS-speculators eyas}
for t in $TRAINERS; do
  budget_of "$t" >/dev/null || { echo "chain: Q_TRAINERS='$TRAINERS': '$t' is no trainer (speculators, eyas)"; exit 2; }
done
# the data serve this session's trainers only: one of them, one copy of the states on disk
Q_DATA_FOR=$(echo $TRAINERS | tr ' ' ','); export Q_DATA_FOR
phase data "${Q_DATA_S:-300}" main "" || exit 1
for t in $TRAINERS; do phase "$t" "$(budget_of "$t")" main "$t"; done
phase rest "${Q_REST_S:-420}" rest
