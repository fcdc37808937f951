"""Run a command and say how it ended: its exit status, or the signal that killed it.

`timeout` reports 124 whatever became of its command, and a shell gives 130 both for a command
that exited with 130 (eyas's stop with a checkpoint) and for one killed by SIGINT's default action.
This tells them apart: ``timeout -s INT 480 python3 how_it_ended.py eyas pipeline CONFIG``.

The signals of `timeout` reach this process too (it runs in the command's process group): it
ignores SIGINT and SIGTERM, so it outlives the command to report; the command gets the default
dispositions back before it starts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

STOPS = (signal.SIGINT, signal.SIGTERM)


def _defaults() -> None:
    for sig in STOPS:
        signal.signal(sig, signal.SIG_DFL)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: how_it_ended.py COMMAND [ARG ...]", file=sys.stderr)
        return 2
    for sig in STOPS:
        signal.signal(sig, signal.SIG_IGN)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, preexec_fn=_defaults)  # noqa: PLW1509 - only resets two signals
    code = proc.wait()
    took = time.monotonic() - t0
    if code < 0:
        print(f"how_it_ended: {argv[0]} killed by {signal.Signals(-code).name} after {took:.1f} s", flush=True)
        return 128 - code
    print(f"how_it_ended: {argv[0]} exited with {code} after {took:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
