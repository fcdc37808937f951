"""The worker's side of eyas's child-process protocol (eyas/vllm/process.py).

``Channel()`` takes the process's stdout for replies and sends everything else printed to fd 1
(vLLM's own output) to stderr, the job's log, so nothing can corrupt a reply. Requests are one
JSON object per stdin line; ``{"op": "quit"}`` or the end of stdin ends them.

``guard_engine()``, which every job calls first, ends vLLM's processes with the worker and keeps
their shared memory from outliving them (see there).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PREFIX = "EYAS-JSON "


def guard_engine(grace_s: float = 30.0) -> None:
    """Make sure vLLM's processes under this worker end with it, leaving nothing in /dev/shm.

    Every job calls this first, before any thread or engine exists. vLLM's engine core and workers
    are this worker's children: when the worker is killed (eyas gives it a parent-death signal),
    they run on, re-parented, holding their memory. eyas starts the worker as the leader of a
    process group of its own, which vLLM's processes join, so a watchdog forked here waits for the
    worker to end and then ends what is left of the group: SIGTERM, up to ``grace_s`` s, SIGKILL.

    vLLM unlinks its shared-memory queues (``/dev/shm/psm_*``) and semaphores (``sem.mp-*``) in its
    own shutdown, which SIGTERM runs; what a killed process left, Python's multiprocessing
    resource tracker unlinks once every process of the engine has exited. The tracker is started
    here, so that vLLM's processes share it, and neither eyas nor the watchdog signals it (it
    ignores SIGTERM and exits by itself after the engine)."""
    if not sys.platform.startswith("linux"):
        return
    worker = os.getpid()
    if os.getpgrp() == worker and os.fork() == 0:
        _watch(worker, grace_s)  # never returns
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is Python's multiprocessing resource tracker (see :func:`guard_engine`)."""
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def proc_stats() -> dict[int, list[str]]:
    """Every process's ``/proc/PID/stat`` fields after its name: state, ppid, pgrp, ..."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            out[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or one being reaped, has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def signal_pids(pids: list[int], sig: int) -> None:
    """``sig`` to each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # gone meanwhile


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` but this one and the resource tracker."""
    return [
        pid
        for pid, fields in proc_stats().items()
        if int(fields[2]) == pgid and fields[0] != "Z" and pid != os.getpid() and not is_resource_tracker(pid)
    ]


def _watch(worker: int, grace_s: float) -> None:
    """The watchdog's life (a fork of the worker): none of the worker's pipes, so eyas sees the
    worker's end at once; when the worker is gone, end the rest of its group, then exit."""
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # eyas's stop() signals the whole tree
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.closerange(3, 65536)
        while os.getppid() == worker:
            time.sleep(0.5)
        signal_pids(group_members(worker), signal.SIGTERM)  # once: a second could cut vLLM's shutdown short
        end = time.monotonic() + grace_s
        while group_members(worker) and time.monotonic() < end:
            time.sleep(0.5)
        signal_pids(group_members(worker), signal.SIGKILL)
    finally:
        os._exit(0)


def read_job(path: str) -> dict:
    return json.loads(Path(path).read_text())


class Channel:
    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # everything else printed to fd 1 lands in the log

    def reply(self, obj: dict) -> None:
        self._out.write(PREFIX + json.dumps(obj) + "\n")
        self._out.flush()

    def wait_for(self, op: str) -> bool:
        """Block until ``{"op": op}`` arrives; False at ``quit`` or the end of stdin."""
        for line in sys.stdin:
            if line.strip():
                return json.loads(line).get("op") == op
        return False

    def requests(self):
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            if req.get("op") == "quit":
                return
            yield req
