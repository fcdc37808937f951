#!/usr/bin/env bash
# Follow a job of detach.sh for at most SECONDS (default 50, less once it ends): every 10 s a line of
# the machine's state (memory used and available, the GPU's memory and load, /dev/shm and / used, the
# largest process), then the job's console since the last watch (no progress bars), and its OUT so
# far as NAME.tgz in this call's OUT. Exit status: the job's once it has ended, else 0 ("running");
# 2 for no such job.
#
#   bash benchmarks/gpu/watch.sh NAME [SECONDS]
set -uo pipefail
NAME=${1:?usage: watch.sh NAME [SECONDS]}
S=${2:-50}
D=${BG_ROOT:-/root/bg}/$NAME
[ -f "$D/t0" ] || { echo "watch: no job $NAME in ${BG_ROOT:-/root/bg} (start it with detach.sh)"; exit 2; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
sample() {
  printf '%s job %ss: mem %s; gpu %s; shm %s, / %s used; top %s\n' "$(date +%T)" "$(( $(date +%s) - $(cat "$D/t0") ))" \
    "$(free -m | awk '/^Mem/ {print $3 " MiB used, " $7 " MiB available"}')" \
    "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null | head -1 || echo -)" \
    "$(df -h --output=used /dev/shm | tail -1 | tr -d ' ')" "$(df -h --output=used / | tail -1 | tr -d ' ')" \
    "$(ps -eo rss=,args= --sort=-rss | head -1 | awk '{printf "%d MiB ", $1 / 1024; $1 = ""; print}' | cut -c1-90)"
}
end=$(( $(date +%s) + S ))
while [ ! -f "$D/rc" ] && [ "$(date +%s)" -lt "$end" ]; do
  sample
  left=$(( end - $(date +%s) ))
  sleep "$(( left > 10 ? 10 : (left > 0 ? left : 0) ))"
done
sample
off=$(cat "$D/offset" 2>/dev/null || echo 0)
size=$(wc -c < "$D/log.txt")
tail -c +"$(( off + 1 ))" "$D/log.txt" | head -c "$(( size - off ))" | tr '\r' '\n' |
  grep -v -E '%\||\[[0-9]{2}:[0-9]{2}[<,]|^\s*$'
echo "$size" > "$D/offset"
tar -czf "$OUT/$NAME.tgz" -C "$D" out log.txt 2>/dev/null
if [ -f "$D/rc" ]; then
  echo "watch: $NAME ended with status $(cat "$D/rc") after $(( $(stat -c %Y "$D/rc") - $(cat "$D/t0") )) s"
  exit "$(cat "$D/rc")"
fi
echo "watch: $NAME running"
