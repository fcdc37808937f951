"""A training step that does not end says where it hangs: while a step runs, Python's faulthandler
is armed to write every thread's stack once the step has run ``STEP_S`` (``COMPILE_S`` while the
first steps compile), and again as often while it still runs. Nothing is stopped.

The stacks go to a file in the run's folder where one is given: a console that stops reading (a
full pipe) blocks every write to stderr, the stacks' too, and a step stuck that way is the one to
explain. A step that ends after such a dump says on stderr where its stacks are."""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path
from typing import IO

# the first steps compile (minutes on a large target); later ones take seconds at most
COMPILE_S, STEP_S = 1200.0, 60.0


class StallWatch:
    """``arm(compiling)`` before a step, ``disarm()`` after it (and on leaving the ``with``)."""

    def __init__(self, path: Path | None = None, step_s: float = STEP_S, compile_s: float = COMPILE_S):
        self.path, self.step_s, self.compile_s = path, step_s, compile_s
        self.file: IO | None = None if path is not None else _stderr()
        self._armed: tuple[float, float, int] | None = None  # when, the limit, the file's size then

    def arm(self, compiling: bool = False) -> None:
        if self.file is None and self.path is not None:
            self.file = open(self.path, "a")  # noqa: SIM115 - faulthandler writes to it until __exit__
        if self.file is not None:
            limit = self.compile_s if compiling else self.step_s
            self._armed = (time.monotonic(), limit, self._size())
            faulthandler.dump_traceback_later(limit, repeat=True, file=self.file)

    def disarm(self) -> None:
        if self._armed is None:
            return
        faulthandler.cancel_dump_traceback_later()
        t0, limit, size = self._armed
        self._armed = None
        if self.path is not None and self._size() > size:
            print(
                f"a training step ran {time.monotonic() - t0:.0f} s, past its {limit:g} s: every thread's "
                f"stack while it ran is in {self.path}",
                file=sys.stderr,
                flush=True,
            )

    def _size(self) -> int:
        return os.fstat(self.file.fileno()).st_size if self.file is not None else 0

    def __enter__(self) -> StallWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.disarm()
        if self.path is not None and self.file is not None:
            self.file.close()
            if self.path.stat().st_size == 0:
                self.path.unlink()  # no stall: no file


def _stderr() -> IO | None:
    """A stderr with a file descriptor (faulthandler writes to one); None where there is none."""
    for f in (sys.stderr, sys.__stderr__):
        try:
            f.fileno()
            return f
        except (AttributeError, OSError, ValueError):
            continue
    return None
