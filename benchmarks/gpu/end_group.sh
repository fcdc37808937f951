#!/usr/bin/env bash
# End what is left of process group PGID (a finished command's children: vLLM's engine core outlives
# a parent that ends by os._exit) and wait until the GPU memory they held is free, so that the next
# engine of the call finds it.
#
#   bash benchmarks/gpu/end_group.sh PGID [LABEL]
PGID=${1:?usage: end_group.sh PGID [LABEL]} LABEL=${2:-group $1}
left=$(pgrep -g "$PGID" | wc -l)
[ "$left" -eq 0 ] && exit 0
kill -TERM -- -"$PGID" 2>/dev/null
for _ in $(seq 20); do
  pgrep -g "$PGID" > /dev/null || break
  sleep 0.5
done
kill -KILL -- -"$PGID" 2>/dev/null
# the driver frees a dead process's memory a moment after it is reaped
for _ in $(seq 20); do
  pgrep -g "$PGID" > /dev/null || break
  sleep 0.5
done
used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | awk '{s += $1} END {if (NR) print s}')
echo "end_group: $LABEL left $left process(es); ended; GPU memory used now ${used:-?} MiB"
