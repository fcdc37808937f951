"""The bytes under a directory tree, and their peak while something runs (tests and benchmarks of
the streamed-feature buffer measure its bound from outside the process that keeps it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass  # deleted between the listing and the stat
    return total


class DiskPeak:
    """The largest number of bytes seen under ``root``, sampled every ``interval`` seconds."""

    def __init__(self, root: Path, interval: float = 0.002):
        self.root, self.interval, self.peak, self.samples = root, interval, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, dir_bytes(self.root))
            self.samples += 1
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak
