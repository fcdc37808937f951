#!/usr/bin/env bash
# Carry a second built-in target to the lent H200 (no network there, 64 MiB per call):
#
#   bash benchmarks/gpu/target_pack.sh qwen2.5-coder-0.5b-instruct     # -> .carry/t0 .. .carry/tN
#
# eyas resolves the target here as a user's machine would (its wheels joined into the GGUF, checked
# by sha256, kept in the eyas cache); this splits that file into parts of at most $PART_MB MB, one per
# .carry/tI, each with a line naming the file, its sha256 and the part count. Carry one per call,
# back to back; benchmarks/gpu/setup.sh parks them and joins them into the device's eyas cache once
# every part is there, where eyas finds the GGUF and checks it again.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.carry/' .gitignore
NAME=${1:?usage: target_pack.sh BUILTIN_TARGET_NAME}
PART_MB=${PART_MB:-55}
PY=${PY:-.venv/bin/python}
read -r FILE SHA < <("$PY" - "$NAME" <<'PY'
import sys
from eyas.target import BUILTIN_TARGETS, resolve_target
info = BUILTIN_TARGETS[sys.argv[1]]
resolve_target(sys.argv[1])  # fetches, checks and converts it, as `eyas prepare --target` would
print(info["file"], info["sha256"])
PY
)
GGUF=${EYAS_CACHE:-$HOME/.cache/eyas}/gguf/$FILE
w=$(mktemp -d)
split -b "${PART_MB}M" -d -a 2 "$GGUF" "$w/target.part"
n=$(ls "$w" | wc -l)
rm -rf .carry/t[0-9]*
i=0
for p in "$w"/target.part*; do
  mkdir -p ".carry/t$i" && mv "$p" ".carry/t$i/"
  echo "$FILE $SHA $n" > ".carry/t$i/target.parts"
  i=$((i + 1))
done
rm -rf "$w"
echo "target $NAME: $FILE in $n parts (.carry/t0 .. .carry/t$((n - 1))), $(du -shc .carry/t[0-9]* | tail -1 | cut -f1)"
