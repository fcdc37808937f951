#!/usr/bin/env bash
# End what is left of process group PGID (a finished command's children: vLLM's engine core outlives
# a parent that ends by os._exit) and wait until they are gone, so that the GPU memory they held is
# free for the call's next engines. Says what it found and the GPU memory used after.
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
for _ in $(seq 20); do
  pgrep -g "$PGID" > /dev/null || break
  sleep 0.5
done
used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | awk '{s += $1} END {if (NR) print s}')
still=$(pgrep -g "$PGID" | wc -l)
echo "end_group: $LABEL left $left process(es); $([ "$still" -eq 0 ] && echo ended || echo "$still still running");" \
  "GPU memory used now ${used:-?} MiB"
