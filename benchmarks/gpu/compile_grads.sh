#!/usr/bin/env bash
# benchmarks/compile_grads.py's variants on the device machine, a wave of processes at a time
# (one compile state each), then the comparison. Record: $OUT/compile_grads.json + all.log.
# Also parks whatever .carry/c* holds in /root/park for the next calls on the same machine.
set -o pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set}"
mkdir -p /root/park && for d in .carry/c*; do [ -d "$d" ] && cp "$d"/* /root/park/; done; ls -la /root/park
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
W=/dev/shm/cg; rm -rf $W
waves=${WAVES:-"init:3 peaky:3 init:7"}
variants=${VARIANTS:-"ref flex model regions model-masks-out model-flex-out"}
for wave in $waves; do
  s=${wave%:*}; k=${wave#*:}; t0=$(date +%s)
  for v in $variants; do
    (python3 benchmarks/compile_grads.py --work $W --variant $v --state $s --ttt $k 2>&1 | grep -v Warning | sed "s/^/[$v $s ttt$k] /" >> $OUT/all.log) &
  done
  wait
  echo "wave $wave: $(( $(date +%s) - t0 )) s" | tee -a $OUT/all.log
  python3 benchmarks/compile_grads.py --work $W --compare --json $OUT/compile_grads.json | tee $OUT/compare.txt
done
