#!/usr/bin/env bash
# The second prompt set's replay of a draft trained on the device, as a user runs it, its reports back
# in one file: a call returns no folder more than three deep under $OUT, and `--also-k`'s reports lie
# four deep (session 29). Usage (device, after setup):
#   S bash benchmarks/gpu/humaneval.sh runs/smollm2-sampled/train/draft [NAME]
# -> $OUT/NAME.tgz (default eval-humaneval): report.json per k, chains and the target's answers.
set -uo pipefail
DRAFT=${1:?usage: humaneval.sh DRAFT [NAME]} NAME=${2:-eval-humaneval}
cd "$(dirname "$0")/../.." && source benchmarks/gpu/setup.sh > /dev/null
eyas evaluate --engine replay --draft "$DRAFT" --prompts data/humaneval/question.jsonl -k 5 --also-k 3,7 \
  --device cuda --dtype bfloat16 --max-new-tokens 256 --out "$OUT/$NAME" 2>&1 | grep -v "it/s\]\|q/s\]"
rc=${PIPESTATUS[0]}
tar -czf "$OUT/$NAME.tgz" -C "$OUT" "$NAME" && rm -rf "${OUT:?}/$NAME"
exit "$rc"
