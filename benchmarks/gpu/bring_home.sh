#!/usr/bin/env bash
# Here, after the calls of benchmarks/gpu/send_home.sh: join the pieces they returned, check the
# sha256, and pack the directory to travel back to the device in a later session:
#
#   bash benchmarks/gpu/bring_home.sh NAME [PREFIX] [RESULT_DIR ...]   # default: /work/.device/*
#
# Keeps the joined tar in .home/NAME.tar (KEEP_DIR; git-ignored, for a later session's checkout to be
# given by hand), and splits it into .carry/<PREFIX>0 .. (PREFIX k by default; carry_split.sh, kind
# bundle). Carry them one per call like the other parts: setup.sh joins them (carry_join.sh), checks
# the sha256 and unpacks the directory at DEST on the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
NAME=${1:?usage: bring_home.sh NAME [PREFIX] [RESULT_DIR ...]}
PREFIX=${2:-k}
shift $(($# < 2 ? $# : 2))
DIRS=("$@")
[ ${#DIRS[@]} -gt 0 ] || DIRS=(/work/.device/*)
newest() { ls -t "$@" 2>/dev/null | head -1 || true; }  # the newest of these paths that exist
list=$(newest "${DIRS[@]/%//$NAME.home}")
[ -n "$list" ] || { echo "bring_home: no $NAME.home in ${DIRS[*]}" >&2; exit 1; }
read -r _ SHA PIECES DEST PER < "$list"
KEEP=${KEEP_DIR:-.home}  # git-ignored, as .carry (CARRY_DIR, carry_split.sh's)
mkdir -p "$KEEP"
w=$(mktemp -d)
for i in $(seq 0 $((PIECES - 1))); do
  p=$(newest "${DIRS[@]/%//$(printf '%s.p%03d' "$NAME" "$i")}")
  [ -n "$p" ] || { echo "bring_home: piece $i of $PIECES of $NAME is missing: send it again (send_home.sh ... $((i / ${PER:-3})))" >&2; exit 1; }
  cat "$p" >> "$w/$NAME.tar"
done
got=$(sha256sum "$w/$NAME.tar" | cut -d' ' -f1)
[ "$got" = "$SHA" ] || { echo "bring_home: $NAME joined from $PIECES pieces has sha256 $got, not $SHA: nothing kept" >&2; exit 1; }
mv "$w/$NAME.tar" "$KEEP/$NAME.tar"
rm -rf "$w"
bash benchmarks/gpu/carry_split.sh "$KEEP/$NAME.tar" bundle "$NAME" "$SHA" "$PREFIX" "$DEST"
echo "bring_home: $NAME (sha256 ${SHA:0:12}) kept in $KEEP/$NAME.tar; back at $DEST on the device"
