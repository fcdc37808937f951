#!/usr/bin/env bash
# Freeze the committed code for a series of device calls: .carry/snap = `git archive HEAD` of
# src/, benchmarks/ and configs/. Carry it once, then `source benchmarks/gpu/use_snapshot.sh` in every call:
# all calls of one benchmark then run the same commit, whatever is being edited here meanwhile.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .carry/snap && mkdir -p .carry/snap
# code only: the recorded results (benchmarks/quality/h200*) would only eat the call's 64 MiB
git archive HEAD src benchmarks configs ':(exclude)benchmarks/quality/h200*' | tar -x -C .carry/snap
git rev-parse HEAD > .carry/snap/COMMIT
echo "snapshot of $(cat .carry/snap/COMMIT) in .carry/snap ($(du -sh .carry/snap | cut -f1))"
# every part must still fit beside the tree, which grows with the results committed since it was
# packed (session 29 found s0 and s1 1 MB over, with the machine already started); c1 goes with snap
for d in .carry/*/; do
  d=${d%/}
  case $d in .carry/snap | .carry/quality) continue ;; .carry/c1) set -- "$d" .carry/snap ;; *) set -- "$d" ;; esac
  bash benchmarks/gpu/carry_room.sh "$@" > /dev/null || echo "snapshot: $* no longer fits a call beside the tree: $(bash benchmarks/gpu/carry_room.sh "$@")"
done
