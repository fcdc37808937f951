"""The worker's side of eyas's child-process protocol (eyas/vllm/process.py).

``Channel()`` takes the process's stdout for replies and sends everything else printed to fd 1
(vLLM's own output) to stderr, the job's log, so nothing can corrupt a reply. Requests are one
JSON object per stdin line; ``{"op": "quit"}`` or the end of stdin ends them.

``start_resource_tracker()`` starts Python's multiprocessing resource tracker, which every job
calls first, in a process group of its own (see there).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PREFIX = "EYAS-JSON "


def start_resource_tracker() -> None:
    """Start Python's multiprocessing resource tracker now, in a process group of its own.

    vLLM's engine core and workers share this process's tracker (the first to need it starts it;
    their children inherit it). Their shared-memory message queues (``/dev/shm/psm_*``) and
    semaphores (``sem.mp-*``) are unlinked by vLLM's own shutdown only; after a process was
    killed, the tracker unlinks what it left, once every process of the engine has exited. Started from vLLM it is in eyas's process group, so killing that group (a
    crash, the tests' kill of a run) took it as well and the segments stayed until reboot. eyas
    spares it when it kills a worker's processes (``eyas.vllm.process``); it ignores SIGINT and
    SIGTERM and exits by itself with the engine."""
    if not sys.platform.startswith("linux"):
        return
    from multiprocessing import resource_tracker

    group = os.getpgrp()
    try:
        os.setpgid(0, 0)  # a group of our own for a moment: the tracker is forked into it
    except OSError:
        group = None  # a session leader cannot move: the tracker stays in our group
    try:
        resource_tracker.ensure_running()
    finally:
        if group is not None:
            os.setpgid(0, group)  # back to eyas's group; the tracker stays in the new one


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
