#!/usr/bin/env bash
# Split FILE into parts that fit a device call beside the working tree, one per .carry/<PREFIX>I
# (CARRY_DIR), each with the list KIND-<sha12>-of<N>.parts ("NAME SHA N [DEST]"); parts are named
# KIND-<sha12>-of<N>.partNN, so parts of two packings, left on a warm device, never mix.
# carry_join.sh joins them on the device. Used by target_pack.sh (KIND target) and bring_home.sh
# (KIND bundle).
#
#   bash benchmarks/gpu/carry_split.sh FILE KIND NAME SHA PREFIX [DEST]
set -euo pipefail
cd "$(dirname "$0")/../.."
FILE=${1:?usage: carry_split.sh FILE KIND NAME SHA PREFIX [DEST]} KIND=${2:?kind} NAME=${3:?name}
SHA=${4:?sha256} PREFIX=${5:?prefix} DEST=${6:-}
CARRY=${CARRY_DIR:-.carry}
PART_MB=${PART_MB:-$(bash benchmarks/gpu/carry_room.sh)}  # what fits a call beside the tree
w=$(mktemp -d)
split -b "${PART_MB}MB" -d -a 2 "$FILE" "$w/part"
n=$(ls "$w" | wc -l)
stem=$KIND-${SHA:0:12}-of$n
rm -rf "$CARRY/$PREFIX"[0-9]*
i=0
for p in "$w"/part*; do
  mkdir -p "$CARRY/$PREFIX$i" && mv "$p" "$CARRY/$PREFIX$i/$stem.${p##*/}"
  echo "$NAME $SHA $n${DEST:+ $DEST}" > "$CARRY/$PREFIX$i/$stem.parts"
  i=$((i + 1))
done
rm -rf "$w"
echo "$NAME: $n parts of at most $PART_MB MB in $CARRY/${PREFIX}0 .. $CARRY/$PREFIX$((n - 1)), $(du -shc "$CARRY/$PREFIX"[0-9]* | tail -1 | cut -f1)"
