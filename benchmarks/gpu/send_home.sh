#!/usr/bin/env bash
# On the lent H200: bring a directory (a training's last checkpoint, a run's state) back to the CPU
# machine over several calls, since one call returns at most 64 MiB (8 files of 16 MiB):
#
#   bash benchmarks/gpu/send_home.sh SRC NAME CALL [DEST]  # CALL = 0, 1, 2, ... one per device call
#
# DEST (default SRC) is where it is unpacked when it travels back; its last component must be SRC's.
# The first call tars SRC once (to /root/home/NAME.tar: safetensors and optimizer state compress
# poorly, so no compression), records its sha256 and splits it into pieces of 15 MiB (PIECE_MB); each call puts
# PER_CALL of them (3: a call returns at most 8 files, and gpu_job.sh adds its log, steps and results)
# into $OUT as NAME.pNNN, with the list NAME.home ("NAME SHA PIECES DEST PER_CALL").
# It says how many calls the whole takes. Here, benchmarks/gpu/bring_home.sh checks and joins them
# and packs the directory to travel back to DEST in a later session (setup.sh unpacks it there).
set -euo pipefail
SRC=${1:?usage: send_home.sh SRC NAME CALL [DEST]} NAME=${2:?name} CALL=${3:?call index from 0}
OUT=${OUT:?set OUT, the device call output folder} H=${HOME_DIR:-/root/home}
SRC=$(cd "$SRC" && pwd)
DEST=${4:-$SRC}
case $DEST in /*) ;; *) DEST=$PWD/$DEST ;; esac  # absolute: it travels back to the same place
[ "$(basename "$DEST")" = "$(basename "$SRC")" ] || { echo "send_home: DEST $DEST must end in $(basename "$SRC")" >&2; exit 2; }
mkdir -p "$H"
if [ ! -s "$H/$NAME.home" ] || [ "$(cut -d' ' -f4 "$H/$NAME.home")" != "$DEST" ]; then
  rm -f "$H/$NAME".*
  tar -C "$(dirname "$SRC")" -cf "$H/$NAME.tar" "$(basename "$SRC")"
  split -b "${PIECE_MB:-15}M" -d -a 3 "$H/$NAME.tar" "$H/$NAME.p"
  echo "$NAME $(sha256sum "$H/$NAME.tar" | cut -d' ' -f1) $(ls "$H/$NAME".p??? | wc -l) $DEST ${PER_CALL:-3}" > "$H/$NAME.home"
  rm -f "$H/$NAME.tar"
fi
read -r _ _ PIECES _ PER < "$H/$NAME.home"  # the pieces a call takes, as the first call fixed it
cp "$H/$NAME.home" "$OUT/"
first=$((PER * CALL))
[ "$first" -lt "$PIECES" ] || { echo "send_home: $NAME has $PIECES pieces, all sent by calls 0..$(((PIECES - 1) / PER))"; exit 0; }
for i in $(seq "$first" $((first + PER - 1))); do
  p=$(printf '%s/%s.p%03d' "$H" "$NAME" "$i")
  [ -f "$p" ] && cp "$p" "$OUT/"
done
last=$((first + PER - 1 < PIECES - 1 ? first + PER - 1 : PIECES - 1))
echo "send_home: $NAME ($SRC, back to $DEST): pieces $first..$last of $PIECES sent; calls in all: $(((PIECES + PER - 1) / PER))"
