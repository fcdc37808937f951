"""eyas's child-process protocol (eyas.vllm.process): a worker eyas stops takes its own children
with it, as vLLM's engine-core processes are (a worker killed while vLLM was still starting once
left them running, holding gigabytes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from eyas.vllm.process import WorkerProcess, descendants
from eyas.vllm.worker.protocol import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _busy_worker(tmp_path: Path) -> WorkerProcess:
    """A stand-in interpreter that ignores its job and stdin and holds two children, as a vLLM
    worker does while its engine starts."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nsleep 300 &\nsleep 300 &\nwait\n")
    fake.chmod(0o755)
    proc = WorkerProcess(fake, "serve", {}, tmp_path / "work", tmp_path / "worker.log")
    deadline = time.time() + 10
    while len(descendants(proc.proc.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("how", ["close", "stop"])
def test_a_stopped_worker_leaves_no_process_of_its_own_behind(tmp_path, how):
    proc = _busy_worker(tmp_path)
    children = descendants(proc.proc.pid)
    assert len(children) == 2 and all(alive(c) for c in children)
    if how == "close":
        proc.close(timeout=1)  # it does not answer quit: killed after the timeout
    else:
        proc.stop()
    deadline = time.time() + 10
    while any(alive(c) for c in children) and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is not None
    assert not [c for c in children if alive(c)], "the worker's children outlived it"


def test_a_resumed_worker_keeps_the_last_runs_log_beside_its_own(tmp_path):
    """A worker started again with the same log (a run resumed after a time limit) moves the earlier
    log to NAME.prev, so what the stopped engine did is not overwritten; the new log starts empty."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho second run >&2\n")
    fake.chmod(0o755)
    log = tmp_path / "worker.log"
    log.write_text("first run, stopped at its time limit\n")
    proc = WorkerProcess(fake, "serve", {}, tmp_path / "work", log, interactive=False)
    proc.proc.wait(10)
    proc.stop()
    assert (tmp_path / "worker.log.prev").read_text() == "first run, stopped at its time limit\n"
    assert log.read_text() == "second run\n"
