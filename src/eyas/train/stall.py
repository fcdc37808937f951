"""A training step that does not end says where it hangs: while a step runs, Python's faulthandler
is armed to print every thread's stack to stderr once the step has run ``STEP_S`` (``COMPILE_S``
while the first steps compile), and again as often while it still runs. Nothing is stopped; the
stacks go where the run's log goes."""

from __future__ import annotations

import faulthandler
import sys
from typing import IO

# the first steps compile (minutes on a large target); later ones take seconds at most
COMPILE_S, STEP_S = 1200.0, 60.0


class StallWatch:
    """``arm(compiling)`` before a step, ``disarm()`` after it (and on leaving the ``with``)."""

    def __init__(self, step_s: float = STEP_S, compile_s: float = COMPILE_S):
        self.step_s, self.compile_s = step_s, compile_s
        self.file = _stderr()

    def arm(self, compiling: bool = False) -> None:
        if self.file is not None:
            faulthandler.dump_traceback_later(self.compile_s if compiling else self.step_s, repeat=True, file=self.file)

    def disarm(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()

    def __enter__(self) -> StallWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.disarm()


def _stderr() -> IO | None:
    """A stderr with a file descriptor (faulthandler writes to one); None where there is none."""
    for f in (sys.stderr, sys.__stderr__):
        try:
            f.fileno()
            return f
        except (AttributeError, OSError, ValueError):
            continue
    return None
