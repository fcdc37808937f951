"""A job's end, where its scheduler sets one: ``EYAS_STOP_AT`` (seconds since the epoch). Long
resumable work checks it before starting a part that would not finish in the time left, and stops
between parts instead; the next run goes on from there (a part cut half-way is done again)."""

from __future__ import annotations

import os
import time

from eyas.errors import EyasError

ENV = "EYAS_STOP_AT"


class OutOfTime(EyasError):
    """Stopped between two parts of resumable work: the next part would not end by ``EYAS_STOP_AT``."""


def left() -> float | None:
    """Seconds until ``EYAS_STOP_AT`` (negative once past it); None where it is not set."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw) - time.time()
    except ValueError:
        raise EyasError(
            f"{ENV}={raw!r}: not a time; give seconds since the epoch, e.g. $(date -d '+50 min' +%s)"
        ) from None


def check(need_s: float, what: str) -> None:
    """OutOfTime if ``EYAS_STOP_AT`` leaves less than ``need_s`` for ``what`` (the time a part like
    it took in this run)."""
    have = left()
    if have is not None and have < need_s:
        raise OutOfTime(
            f"stopped before {what}: a part like it took {need_s:.0f} s in this run, and {max(have, 0):.0f} s "
            f"are left before {ENV}; run the same command again to go on from here"
        )
