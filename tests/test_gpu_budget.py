"""The device scripts' time budget (benchmarks/gpu/budget.sh): BUDGET_S counts from the call's
start, never gives timeout a 0 or less, and tells eyas when to stop starting resumable parts."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

BUDGET = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "budget.sh"


def bash(script: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "BUDGET_S"}
    out = subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(BUDGET))}; {script}"],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def test_budget_counts_from_the_call_start() -> None:
    # the clock starts when budget.sh is sourced, so time spent before the step comes off
    assert 530 <= int(bash("sleep 2; budget 540")) <= 538
    assert 90 <= int(bash("sleep 2; budget 540", BUDGET_S="100")) <= 98


def test_budget_floor_is_30_seconds() -> None:
    assert int(bash("budget 540", BUDGET_S="10")) == 30
    assert int(bash("budget 540", BUDGET_S="-5")) == 30


def test_until_budget_runs_the_command_with_a_stop_time() -> None:
    before = int(time.time())
    out = bash("until_budget 5 540 bash -c 'echo stop=$EYAS_STOP_AT'", BUDGET_S="200").splitlines()
    assert out[0].startswith("budget: ") and "of BUDGET_S left" in out[0]
    stop = int(out[1].removeprefix("stop="))
    # 5 s before the SIGINT at the budget's end
    assert before + 200 - 5 - 2 <= stop <= int(time.time()) + 200 - 5
