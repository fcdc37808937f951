#!/usr/bin/env bash
# On the device: join what carry_split.sh split, once all its parts are parked in PARK, and keep it
# only when its sha256 is the one listed; never over an existing result.
#
#   bash benchmarks/gpu/carry_join.sh PARK target DIR   # a target's GGUF, as DIR/NAME (setup.sh)
#   bash benchmarks/gpu/carry_join.sh PARK bundle       # a run brought home (bring_home.sh), unpacked at DEST
PARK=${1:?usage: carry_join.sh PARK target DIR | PARK bundle} KIND=${2:?target or bundle} DIR=${3:-}
[ "$KIND" = bundle ] || [ -n "$DIR" ] || { echo "carry_join: KIND target needs the DIR to join into" >&2; exit 2; }
for list in "$PARK/$KIND"-*.parts; do
  [ -s "$list" ] || continue
  read -r NAME SHA N DEST < "$list"
  [ "$KIND" = bundle ] || DEST=$DIR/$NAME
  stem=${list%.parts}
  have=$(ls "$stem".part?? 2>/dev/null | wc -l)
  if [ ! -e "$DEST" ] && [ "$have" -eq "$N" ]; then
    mkdir -p "$(dirname "$DEST")"
    cat "$stem".part?? > "$DEST.tmp"
    if [ "$(sha256sum "$DEST.tmp" | cut -d' ' -f1)" != "$SHA" ]; then
      echo "carry_join: $NAME joined from ${stem##*/}.part00 .. has another sha256 than $SHA; not kept (carry its parts again)"
    elif [ "$KIND" = bundle ]; then
      tar -C "$(dirname "$DEST")" -xf "$DEST.tmp"
    else
      mv "$DEST.tmp" "$DEST"
    fi
    rm -f "$DEST.tmp"
  fi
  echo "carry_join: $NAME $( [ -e "$DEST" ] && echo "at $DEST" || echo "$have of $N parts")"
done
