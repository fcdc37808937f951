#!/usr/bin/env bash
# How much a device call may carry beside the working tree, which travels with every call (tracked and
# untracked-not-ignored files; the device's limit is 64 MiB for both together):
#
#   bash benchmarks/gpu/carry_room.sh              # -> MB (10^6 bytes) a carried part may have
#   bash benchmarks/gpu/carry_room.sh PATH ...     # does a call carrying these paths fit? (exit 1 if not)
#
# The packers (pack.sh, target_pack.sh, vllm_pack.sh) size their parts by it. MARGIN_MB (2) leaves
# room for the tree to grow between packing and the call (results committed meanwhile). The tree
# counts in whole 4 KiB blocks per file: counted by apparent size, a 40 MB part beside a 26 MB tree
# "fit" and the device refused it (2026-12-07, `../gpu_job.md` session 33).
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=$((64 * 1024 * 1024))
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c '%b %B' 2>/dev/null | awk '{s += $1 * $2} END {print s + 0}')
if [ $# -eq 0 ]; then
  echo $(( (LIMIT - tree) / 1000000 - ${MARGIN_MB:-2} ))
  exit 0
fi
carried=$(du -sb "$@" | awk '{s += $1} END {print s + 0}')
total=$((tree + carried))
verdict=$([ "$total" -le "$LIMIT" ] && echo fits || echo "does NOT fit")
echo "tree $((tree / 1000000)) MB + $* $((carried / 1000000)) MB = $((total / 1000000)) MB of $((LIMIT / 1000000)) MB: $verdict"
[ "$total" -le "$LIMIT" ]
