#!/usr/bin/env bash
# Run a long job on the device apart from the call that starts it: the call returns at once, and the
# job runs on in a session of its own (such processes outlive their call: leftovers.sh spawn).
# `watch.sh NAME` follows it, one short call after another, so that when a machine stops answering
# mid-job (sessions 11, 14 and 19 of ../gpu_job.md) the last call that answered shows its memory,
# disks and log lines up to then.
#
#   bash benchmarks/gpu/detach.sh NAME CMD...
#
# CMD runs in a copy of this tree (a later call's tree replaces this one, and the job must not see its
# files change), with OUT=$BG_ROOT/NAME/out; its console goes to $BG_ROOT/NAME/log.txt and its exit
# status to $BG_ROOT/NAME/rc. BG_ROOT defaults to /root/bg.
set -uo pipefail
NAME=${1:?usage: detach.sh NAME CMD...}
shift
[ $# -gt 0 ] || { echo "detach: no command for $NAME; usage: detach.sh NAME CMD..."; exit 2; }
D=${BG_ROOT:-/root/bg}/$NAME
if [ -f "$D/pid" ] && [ ! -f "$D/rc" ] && kill -0 "$(cat "$D/pid")" 2>/dev/null; then
  echo "detach: $NAME is still running (pid $(cat "$D/pid")); follow it with watch.sh $NAME"
  exit 1
fi
rm -rf "$D" && mkdir -p "$D/out" "$D/tree"
# the tree without the carried parts, which setup.sh has parked by now
tar -cf - --exclude=./.carry --exclude=./.git --exclude=./.venv . | tar -xf - -C "$D/tree"
date +%s > "$D/t0"
(
  cd "$D/tree" || exit 1
  # the copy's src/ first: the editable install of eyas points at the call's tree
  export OUT=$D/out PYTHONPATH=$D/tree/src${PYTHONPATH:+:$PYTHONPATH}
  setsid bash -c '"$@"; echo $? > "$0/rc"' "$D" "$@" < /dev/null > "$D/log.txt" 2>&1 &
  echo $! > "$D/pid"
)
echo "detach: $NAME started (pid $(cat "$D/pid")) at $(date +%T) in $D/tree: $*"
