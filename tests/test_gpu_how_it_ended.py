"""benchmarks/gpu/how_it_ended.py under `timeout -s INT`: it tells a command that exited after the
signal from one the signal killed, where `timeout` reports 124 for both."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "how_it_ended.py"

# a command that handles SIGINT and exits with 130, as eyas does after its stop checkpoint
HANDLES = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); time.sleep(30)"
# one that leaves SIGINT at its default action: the signal ends it without a word
DIES = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); time.sleep(30)"


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs GNU timeout")
@pytest.mark.parametrize(("code", "said"), [(HANDLES, "exited with 130"), (DIES, "killed by SIGINT")])
def test_it_says_how_the_command_ended_at_the_signal(code, said):
    res = subprocess.run(
        ["timeout", "--preserve-status", "-s", "INT", "2", sys.executable, str(SCRIPT), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert said in res.stdout, (res.stdout, res.stderr)
    assert res.returncode == 130  # the same status both ways: only the line tells them apart


def test_a_command_that_ends_on_its_own_keeps_its_status():
    res = subprocess.run(
        [sys.executable, str(SCRIPT), sys.executable, "-c", "raise SystemExit(3)"], capture_output=True, text=True
    )
    assert res.returncode == 3 and "exited with 3" in res.stdout
