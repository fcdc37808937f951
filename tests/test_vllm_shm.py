"""A vLLM engine that eyas stops, that is killed with eyas's whole process group, or whose eyas is
killed alone, ends, and leaves none of its shared memory behind in /dev/shm.

vLLM (CPU build 0.32.0 here) gives each engine shared-memory message queues (``psm_*``) and a
semaphore (``sem.mp-*``), which it unlinks only when it shuts down; what a killed process left,
Python's resource tracker unlinks, unless it was killed too. ``WorkerProcess.stop()`` sent SIGKILL
to the whole engine a moment after SIGTERM, tracker included, and a killed process group took the
tracker with it: such an engine's segments stayed in /dev/shm until reboot. And eyas killed alone
left vLLM's processes running, re-parented, until the worker's watchdog (``guard_engine``). Here
eyas runs in a session of its own (a helper script), so that its whole process group can be killed
as a crash would, leaving the test alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tiny
from vllm_envs import vllm_python

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /dev/shm"),
]

SHM = Path("/dev/shm")

# eyas's side: start the engine, print its processes once it is ready, then stop it when told
HELPER = """
import json, sys
from pathlib import Path
from eyas.vllm.process import WorkerProcess, descendants

python, job, work = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
proc = WorkerProcess(python, "generate", job, work, work / "generate.log", multiprocessing=True, cwd=work)
proc.read()
print(json.dumps([proc.proc.pid, *descendants(proc.proc.pid)]), flush=True)
if sys.stdin.readline().strip() == "stop":
    proc.stop()
"""


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """Llama, 2 layers, head_dim 32 (the smallest vLLM's CPU attention takes), fp32."""
    return tiny.make_target(tmp_path_factory.mktemp("shm-target"), num_layers=2, hidden=128, seed=1, head_dim=32)


def _shm_mapped(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes have mapped: the engine's own, not another test's."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5:]
            if path and path[0].startswith(f"{SHM}/"):
                names.add(path[0][len(f"{SHM}/") :].removesuffix(" (deleted)"))
    return {n for n in names if (SHM / n).exists()}


@pytest.mark.parametrize("how", ["stop", "killed-group", "killed-eyas"])
def test_an_ended_engine_leaves_no_shared_memory(target, tmp_path, how):
    py = vllm_python("0.32.0")
    job = {"model": str(target), "work_dir": str(tmp_path / "work"), "max_model_len": 128, "seed": 0}
    job["dtype"] = "float32"
    (tmp_path / "work").mkdir()
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, py, json.dumps(job), str(tmp_path / "work")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which the crash kills whole
    )
    try:
        line = helper.stdout.readline()
        assert line, f"the engine did not start; its log:\n{(tmp_path / 'work' / 'generate.log').read_text()[-3000:]}"
        pids = json.loads(line)
        segments = _shm_mapped(pids)
        assert any(n.startswith("psm_") for n in segments), f"no shared-memory queue mapped: {segments}"
        if how == "stop":
            helper.stdin.write("stop\n")
            helper.stdin.flush()
            helper.wait(timeout=60)
        else:
            kill = os.killpg if how == "killed-group" else os.kill  # a crash of the group, or of eyas alone
            kill(helper.pid, signal.SIGKILL)
            helper.wait()
    finally:
        if helper.poll() is None:
            os.killpg(helper.pid, signal.SIGKILL)
            helper.wait()
    deadline = time.time() + 45  # the watchdog's SIGTERM, vLLM's shutdown, the tracker's unlinking
    while (_running(pids) or any((SHM / n).exists() for n in segments)) and time.time() < deadline:
        time.sleep(0.2)
    assert not _running(pids), f"vLLM's processes outlived the run: {_running(pids)}"
    assert not [n for n in segments if (SHM / n).exists()], f"left in {SHM} of {sorted(segments)}"


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not zombies), Python's resource tracker left out: it ends by
    itself once every process that used it has."""
    from eyas.vllm.worker.protocol import alive, is_resource_tracker

    return [p for p in pids if alive(p) and not is_resource_tracker(p)]
