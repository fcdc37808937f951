"""Loops in answers: the repeats of a cycle that runs to the answer's end.

A small model decoding greedily often falls into a cycle and repeats it until --max-new-tokens
cuts it (`benchmarks/heldout_loops.md`), so most tokens of such answers are copies of one cycle.
``eyas prepare --mask-loops`` leaves those copies out of the loss past the cycle's first
KEPT_PERIODS periods: the draft still learns that a loop goes on, and the rest of its training
tokens are the answers' content.
"""

from __future__ import annotations

import numpy as np

MAX_PERIOD = 256  # longest cycle looked for, in tokens
MIN_LOOP_TOKENS = 32  # a shorter periodic tail is an answer's ending, not a loop
KEPT_PERIODS = 2  # periods of a loop that stay trained on


def loop_start(ids: np.ndarray) -> int | None:
    """The index from which ``ids`` repeat a cycle up to their end, past the cycle's first
    KEPT_PERIODS periods, or None where they do not end in a loop.

    A loop is a tail of at least MIN_LOOP_TOKENS tokens and KEPT_PERIODS + 1 periods in which every
    token equals the one a period before it, for a period of at most MAX_PERIOD tokens. Of the
    periods that fit, the one whose masked part starts earliest wins."""
    ids = np.asarray(ids)
    n = len(ids)
    best = None
    for period in range(1, min(MAX_PERIOD, n // (KEPT_PERIODS + 1)) + 1):
        if ids[-1] != ids[-1 - period]:
            continue
        differ = np.flatnonzero(ids[:-period] != ids[period:])
        start = int(differ[-1]) + 1 if differ.size else 0  # the periodic tail is ids[start:]
        if n - start >= max((KEPT_PERIODS + 1) * period, MIN_LOOP_TOKENS):
            cut = start + KEPT_PERIODS * period
            best = cut if best is None else min(best, cut)
    return best
