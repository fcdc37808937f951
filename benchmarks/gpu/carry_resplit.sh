#!/usr/bin/env bash
# Split again, smaller, the parts of one carried file once they no longer fit a device call beside the
# working tree (the tree grows with every commit; carry_room.sh says what fits now):
#
#   bash benchmarks/gpu/carry_resplit.sh PREFIX     # .carry/PREFIX0 .. N, e.g. s (target), d, k, v
#
# Both kinds of parts: carry_split.sh's (KIND-<sha12>-of<N>.partNN with its .parts list) and
# vllm_pack.sh's (vllm-wheels.tar.partNN with MANIFEST). The joined file is checked against its
# sha256 before it is split. Parts that keep their count keep their names: on a device still warm
# from calls that parked the old ones, carry every new part (carry_join.sh refuses a mixed join).
set -euo pipefail
cd "$(dirname "$0")/../.."
PREFIX=${1:?usage: carry_resplit.sh PREFIX}
CARRY=${CARRY_DIR:-.carry}
first=$CARRY/${PREFIX}0
[ -d "$first" ] || { echo "carry_resplit: no $first" >&2; exit 1; }
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
if [ -f "$first/MANIFEST" ]; then
  sha=$(sed -n 's/^sha256=//p' "$first/MANIFEST") ver=$(sed -n 's/^vllm=//p' "$first/MANIFEST")
  n=$(sed -n 's/^parts=//p' "$first/MANIFEST")
  for i in $(seq 0 $((n - 1))); do cat "$CARRY/$PREFIX$i"/vllm-wheels.tar.part[0-9]*; done > "$w/joined"
else
  list=$(ls "$first"/*.parts)
  read -r name sha n dest < "$list"
  stem=$(basename "$list" .parts)
  kind=${stem%%-*}
  for i in $(seq 0 $((n - 1))); do cat "$CARRY/$PREFIX$i/$stem".part[0-9]*; done > "$w/joined"
fi
[ "$(sha256sum "$w/joined" | cut -d' ' -f1)" = "$sha" ] || {
  echo "carry_resplit: $CARRY/${PREFIX}0 .. $((n - 1)) join to another sha256 than $sha; pack them again" >&2; exit 1; }
PART_MB=${PART_MB:-$(bash benchmarks/gpu/carry_room.sh)}
if [ -f "$first/MANIFEST" ]; then
  PART_MB=$PART_MB CARRY_DIR=$CARRY bash benchmarks/gpu/vllm_split.sh "$w/joined" "$sha" "$ver" "$PREFIX"
else
  PART_MB=$PART_MB bash benchmarks/gpu/carry_split.sh "$w/joined" "$kind" "$name" "$sha" "$PREFIX" ${dest:+"$dest"}
fi
