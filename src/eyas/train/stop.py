"""A training run stopped by SIGINT or SIGTERM (Ctrl-C, `timeout -s INT`, a job scheduler) saves
before it stops, so it resumes where it stopped rather than at its last ``--save-every``."""

from __future__ import annotations

import signal
import sys
import threading


class StopRequest:
    """While entered (in the main thread of a single-process run), the first SIGINT or SIGTERM sets
    ``requested``: the trainer finishes the step in flight, saves a checkpoint and stops. A second
    signal stops at once (KeyboardInterrupt), as without it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, enabled: bool = True):
        self.enabled, self.requested = enabled, False
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
            "(send it again to stop at once, without one)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
