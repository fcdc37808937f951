"""A training run stopped by SIGINT or SIGTERM (Ctrl-C, `timeout -s INT`, a job scheduler) saves
before it stops, so it resumes where it stopped rather than at its last ``--save-every``."""

from __future__ import annotations

import os
import signal
import threading
import time


class StopRequest:
    """While entered (in the main thread of a single-process run), the first SIGINT or SIGTERM sets
    ``requested``: the trainer finishes the step in flight, saves a checkpoint and stops. A second
    signal stops at once (KeyboardInterrupt), as without it, unless it comes within ``SAME_S`` of
    the first: GNU `timeout` sends its signal to the command and then to the command's whole
    process group, so the command gets it twice, microseconds apart.

    The handler writes its notice with one ``os.write`` to file descriptor 2, not through
    ``sys.stderr``: a signal that lands while the main thread is inside a write to ``sys.stderr`` (a
    progress bar) would otherwise re-enter that stream's buffer and raise in the step, and a notice
    that cannot be written must not cost the checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    SAME_S = 1.0

    def __init__(self, enabled: bool = True):
        self.enabled, self.requested = enabled, False
        self._first = 0.0
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        return self

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested:
            if time.monotonic() - self._first < self.SAME_S:
                return  # the same stop, sent twice
            raise KeyboardInterrupt
        self.requested, self._first = True, time.monotonic()
        notice = (
            f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
            "(send it again to stop at once, without one)\n"
        )
        try:
            os.write(2, notice.encode())
        except OSError:
            pass  # no console to tell: the stop goes on

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
