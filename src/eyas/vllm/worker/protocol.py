"""The worker's side of eyas's child-process protocol (eyas/vllm/process.py).

``Channel()`` takes the process's stdout for replies and sends everything else printed to fd 1
(vLLM's own output) to stderr, the job's log, so nothing can corrupt a reply. Requests are one
JSON object per stdin line; ``{"op": "quit"}`` or the end of stdin ends them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PREFIX = "EYAS-JSON "


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
