#!/usr/bin/env bash
# Compile caches from one session to the next: a fresh machine compiles cold, minutes of device
# time that a restored cache turns into seconds.
#
#   compile_cache.sh back NAME ROOT "PATHS" ["PATHS" ...]   (in a device call)
#       tars the first set of PATHS (relative to ROOT; the ones that exist) that packs within
#       CACHE_MAX_MB (45), in pieces of CACHE_PIECE_MB (15) MiB as $OUT/NAME.tgz.part0 .. (a file
#       back is at most 16 MiB); a larger set is passed over for the next, smaller one. Nothing
#       where none fits.
#   compile_cache.sh restore TGZ ROOT                        (in a device call, from setup scripts)
#       unpacks TGZ at ROOT once per machine (a mark in CACHE_MARKS, /tmp), where TGZ exists; says
#       what it restored.
#
# Here, after the call: cat /work/.device/N/NAME.tgz.part* > .carry/NAME/NAME.tgz, and carry
# .carry/NAME in a later session's call that sources the setup script which restores it.
set -uo pipefail
verb=${1:?usage: compile_cache.sh back NAME ROOT PATHS... | restore TGZ ROOT}
case $verb in
  back)
    name=${2:?NAME} root=${3:?ROOT}
    shift 3
    [ $# -gt 0 ] || { echo "compile_cache: no sets of paths given"; exit 2; }
    out=${OUT:?OUT: where the pieces go}
    max=$(( ${CACHE_MAX_MB:-45} * 1000000 ))
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    rm -f "$out/$name".tgz.part*
    for set in "$@"; do
      have=()
      # a cache with no file in it (made, nothing compiled) is none
      for p in $set; do [ -n "$(find "$root/$p" -type f -print -quit 2>/dev/null)" ] && have+=("$p"); done
      if [ ${#have[@]} = 0 ]; then echo "compile_cache: $name ($set): none on this machine"; continue; fi
      # locks are per process; a stale one would only be waited on
      tar -czf "$tmp/c.tgz" --exclude='*.lock' -C "$root" "${have[@]}" || continue
      size=$(stat -c %s "$tmp/c.tgz")
      if [ "$size" -le "$max" ]; then
        split -b "${CACHE_PIECE_MB:-15}M" -d -a 1 "$tmp/c.tgz" "$out/$name.tgz.part"
        echo "compile_cache: $name (${have[*]}): $size bytes in $(ls "$out/$name".tgz.part* | wc -l) pieces"
        exit 0
      fi
      echo "compile_cache: $name (${have[*]}): $size bytes, over ${CACHE_MAX_MB:-45} MB"
    done
    echo "compile_cache: $name: nothing brought back"
    ;;
  restore)
    tgz=${2:?TGZ} root=${3:?ROOT}
    done_mark=${CACHE_MARKS:-/tmp}/compile-cache-$(basename "$tgz" .tgz).restored
    [ -s "$tgz" ] || exit 0
    [ -e "$done_mark" ] && exit 0
    if tar -C "$root" -xzf "$tgz"; then
      touch "$done_mark"
      echo "compile_cache: restored $(tar -tzf "$tgz" | cut -d/ -f1-3 | sort -u | tr '\n' ' ')from $tgz"
    else
      echo "compile_cache: $tgz did not unpack; compiling cold"
    fi
    ;;
  *) echo "compile_cache: unknown verb $verb (back, restore)"; exit 2 ;;
esac
