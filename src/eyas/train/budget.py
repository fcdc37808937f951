"""Training to a time budget (``--budget``): time the first steps, then fix the step count so that
the LR schedule's warmup and decay end when the budget does, and the draft at the stop is the
annealed one.

The budget counts the optimizer steps' time only. Set-up and the first step (its compilation) come
before the clock starts; evaluations, checkpoints and tau measurements pause it (:meth:`pause`),
so the plan is not thrown off by them and they are reported beside it. The plan is made once,
checked once at REPLAN_AT, and kept in the scheduler's checkpointed state
(:class:`eyas.train.optim.Schedule`): a run resumed on the same devices keeps it, so kill and resume
stay exact; one resumed on others replans at their pace.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

# How long the steps are timed before the plan: long enough to average over step-to-step jitter,
# short next to the budget (the steps before the plan run at the peak LR after warmup).
MEASURE_FRACTION = 0.03
MEASURE_MIN_S, MEASURE_MAX_S = 1.0, 20.0
MEASURE_MIN_STEPS = 3


# The plan is checked once more at this fraction of the budget, against the pace so far.
REPLAN_AT = 0.5

# Passes over the training split past which a plan warns that more data would teach the draft more
# than more passes (benchmarks/recipe/README.md, all the data against more passes over half;
# benchmarks/quality/RESULTS.md, a 5-minute run of many passes whose curve flattens).
MANY_PASSES = 4.0
# Passes past which data with masked loops (eyas prepare's default) trained a worse draft than the same
# data with the loops in the loss (benchmarks/recipe/README.md, "Masked loops"): the warning says so.
MASKED_LOOPS_PASSES = 12.0


def many_passes(passes: float, budget_s: float, masked_loops: bool = False, skipped_leading: int = 0) -> str | None:
    """The warning for a --budget plan of ``passes`` over the training split, or None; ``masked_loops``:
    the data were prepared with --mask-loops, which lost tau past MASKED_LOOPS_PASSES;
    ``skipped_leading``: conversations eyas prepare skipped for starting with the assistant, which
    ``--leading-assistant trim`` would keep."""
    if passes <= MANY_PASSES:
        return None
    more = "--data, or --max-samples raised in eyas prepare"
    if skipped_leading:
        more += (
            f"; or eyas prepare --leading-assistant trim, which keeps the {skipped_leading:,} conversations "
            "it skipped for starting with the assistant"
        )
    msg = (
        f"--budget {budget_s:g}s plans {passes:.1f} passes over the training split: a draft gains less "
        f"from each pass after the first few, so more conversations ({more}) would likely teach it more "
        "than the rest of this budget"
    )
    if masked_loops and passes > MASKED_LOOPS_PASSES:
        msg += (
            "; with no conversations to add, prepare the data with --no-mask-loops: training on the loops' "
            'tokens too did better at this many passes (benchmarks/recipe/README.md, "Masked loops")'
        )
    return msg


class TrainClock:
    """Seconds spent in training steps since the first steps ended, with pauses left out; a resumed
    run starts from the seconds its checkpoint recorded (``offset``)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.t0: float | None = None
        self.start_step: int | None = None  # the step count when the clock started
        self.offset, self.paused = offset, 0.0
        self._pausing: float | None = None  # when the pause under way began
        self._stopped: float | None = None  # the steps' seconds once the last step ran

    def start(self, done: int) -> None:
        if self.t0 is None:
            self.t0, self.start_step = time.perf_counter(), done

    @property
    def started(self) -> bool:
        return self.t0 is not None

    def steps_s(self) -> float:
        """The steps' seconds, this process's and those before a resume."""
        if self._stopped is not None:
            return self._stopped
        if self.t0 is None:
            return self.offset
        now = time.perf_counter()
        return self.offset + now - self.t0 - self.paused - (now - self._pausing if self._pausing else 0.0)

    def stop(self) -> None:
        """The last step has run: the seconds stay as they are now."""
        self._stopped = self.steps_s()

    def this_run_s(self) -> float:
        return self.steps_s() - self.offset

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Leave what runs inside out of the step time (evaluations, checkpoints, tau)."""
        if self._pausing is not None:  # nested: the outer pause counts it
            yield
            return
        self._pausing = time.perf_counter()
        try:
            yield
        finally:
            if self.t0 is not None:
                self.paused += time.perf_counter() - self._pausing
            self._pausing = None


class BudgetPlanner:
    """How many steps fit in ``budget_s`` of step time: planned once the first steps are timed, and
    checked again at REPLAN_AT of the budget against the pace so far."""

    def __init__(self, budget_s: float, cap: int | None):
        self.budget_s, self.cap = budget_s, cap
        self.step_s: float | None = None  # the measured seconds per step, at the last (re)plan

    def measure_s(self) -> float:
        return min(MEASURE_MAX_S, max(MEASURE_MIN_S, MEASURE_FRACTION * self.budget_s))

    def due(self, clock: TrainClock, schedule) -> str | None:
        """ "plan", "replan" or None: what the run's state and clock call for now."""
        if not clock.started or schedule.replanned_at is not None:
            return None
        # the pace is this process's: a run resumed near REPLAN_AT is timed as long as a plan is, or
        # its first steps after the restart (slower: caches, prefetch) would set the end too early;
        # but no longer than a quarter of what is left, or a run resumed late on faster devices would
        # reach the old plan's end before it replans
        window = min(self.measure_s(), self.budget_s)
        if clock.offset:
            window = min(window, max(0.0, self.budget_s - clock.offset) / 4)
        timed = clock.this_run_s() >= window
        if schedule.planned_at is None:
            return "plan" if timed else None
        return "replan" if timed and clock.steps_s() >= REPLAN_AT * self.budget_s else None

    @staticmethod
    def resumed_elsewhere(schedule, saved_on: str | None, now_on: str) -> bool:
        """A run resumed after its replan on other devices than the checkpoint's replans once more, at
        this machine's pace: the plan's pace was the other machine's, so its end would miss the budget.
        On the same devices the plan stands, so that kill and resume stay exact. True if it will."""
        if saved_on is None or saved_on == now_on or schedule.replanned_at is None:
            return False
        schedule.replanned_at = None
        return True

    def total(self, done: int, clock: TrainClock) -> int | None:
        """The step count that ends the steps' time at the budget, at this run's pace so far (None
        until MEASURE_MIN_STEPS are timed)."""
        timed = done - clock.start_step
        if timed < MEASURE_MIN_STEPS:
            return None
        self.step_s = clock.this_run_s() / timed
        total = done + max(0, int((self.budget_s - clock.steps_s()) / self.step_s))
        total = max(total, done + 1)  # the last step anneals: at least one more, at the floor
        return min(total, self.cap) if self.cap else total
