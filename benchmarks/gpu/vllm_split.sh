#!/usr/bin/env bash
# Split the vLLM wheels' tar into the parts vllm_setup.sh assembles on the device: .carry/vI (CARRY_DIR,
# PREFIX in place of v), each with vllm-wheels.tar.partNN and a MANIFEST (parts, sha256, vllm) that
# vllm_setup.sh reads.
# Used by vllm_pack.sh (a new packing) and carry_resplit.sh (smaller parts of the same tar).
#
#   PART_MB=36 bash benchmarks/gpu/vllm_split.sh TAR SHA256 VLLM_VERSION [PREFIX]
set -euo pipefail
TAR=${1:?usage: vllm_split.sh TAR SHA256 VLLM_VERSION [PREFIX]} SHA=${2:?sha256} VER=${3:?vllm version}
P=${4:-v}
CARRY=${CARRY_DIR:-.carry}
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
split -b "${PART_MB:?PART_MB: the MB a part may have}MB" -d -a 2 "$TAR" "$w/vllm-wheels.tar.part"
parts=("$w"/vllm-wheels.tar.part*)
rm -rf "$CARRY/$P"[0-9]*
for i in "${!parts[@]}"; do
  mkdir -p "$CARRY/$P$i" && mv "${parts[$i]}" "$CARRY/$P$i/"
  printf 'parts=%s\nsha256=%s\nvllm=%s\n' "${#parts[@]}" "$SHA" "$VER" > "$CARRY/$P$i/MANIFEST"
done
echo "vllm $VER: ${#parts[@]} parts of at most $PART_MB MB in $CARRY/${P}0 .. $CARRY/$P$((${#parts[@]} - 1))"
