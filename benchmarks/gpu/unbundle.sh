#!/usr/bin/env bash
# Unpack the directories that bring_home.sh packed (their parts parked in PARK by setup.sh): each
# list bundle-<sha12>-of<N>.parts ("NAME SHA N DEST") is joined once all N parts are there, checked
# against its sha256 and unpacked at DEST; never over an existing DEST, nothing unpacked on a mismatch.
#
#   bash benchmarks/gpu/unbundle.sh PARK
PARK=${1:?usage: unbundle.sh PARK}
for list in "$PARK"/bundle-*.parts; do
  [ -s "$list" ] || continue
  read -r NAME SHA N DEST < "$list"
  stem=${list%.parts}
  have=$(ls "$stem".part?? 2>/dev/null | wc -l)
  if [ ! -e "$DEST" ] && [ "$have" -eq "$N" ]; then
    if [ "$(cat "$stem".part?? | sha256sum | cut -d' ' -f1)" = "$SHA" ]; then
      mkdir -p "$(dirname "$DEST")" && cat "$stem".part?? | tar -C "$(dirname "$DEST")" -xf -
    else
      echo "unbundle: $NAME joined from ${stem##*/}.part00 .. has another sha256 than $SHA; not unpacked (carry its parts again)"
    fi
  fi
  echo "unbundle: $NAME $( [ -e "$DEST" ] && echo "at $DEST" || echo "$have of $N parts")"
done
