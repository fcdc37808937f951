#!/usr/bin/env bash
# On the device (setup.sh, every call): copy what this call carried into PARK, where carry_join.sh
# and setup.sh find it: c* (wheels, prepared data) and every part of a carry_split.sh set, whatever
# its prefix (s and t targets; k, d, e or any name bring_home.sh was given for a run). A set is
# known by its part list (*.parts), not by its prefix, so a run brought home under a new prefix is
# never left out. vLLM's parts (v*) are vllm_setup.sh's.
#
#   bash benchmarks/gpu/park.sh [CARRY] [PARK]      # defaults: .carry /root/park
CARRY=${1:-.carry} PARK=${2:-/root/park}
mkdir -p "$PARK"
for d in "$CARRY"/*/; do
  d=${d%/}
  case ${d##*/} in
    v[0-9]*) continue ;;
    c*) ;;
    *) ls "$d"/*.parts >/dev/null 2>&1 || continue ;;
  esac
  cp -r "$d"/* "$PARK"/
done
