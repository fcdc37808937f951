"""Issue 32's phases as one job (benchmarks/gpu/quality_chain.sh): their order, the trainers asked
for, each phase's share of CHAIN_S, and where the chain stops. gpu_job.sh, which runs a phase on
the device, is stood in for by a script that records how it was called."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"

STUB = """#!/usr/bin/env bash
echo "$1 $QPHASE ${QTRAIN-(both)} $BUDGET_S $(basename "$OUT")" >> "$CALLS"
echo "${Q_DATA_FOR-(unset)}" >> "$CALLS.data_for"
[ "$(basename "$OUT")" = "${FAIL:-}" ] && exit 4
exit 0
"""


def chain(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    tree = tmp_path / "tree"
    (tree / "benchmarks" / "gpu").mkdir(parents=True, exist_ok=True)
    shutil.copy(GPU / "quality_chain.sh", tree / "benchmarks" / "gpu")
    (tree / "benchmarks" / "gpu" / "gpu_job.sh").write_text(STUB)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    Path(f"{calls}.data_for").unlink(missing_ok=True)
    run_env = {**os.environ, "OUT": str(tmp_path / "out"), "CALLS": str(calls), **env}
    for name in ("Q_TRAINERS", "QTRAIN", "FAIL", "Q_DATA_FOR"):
        if name not in env:
            run_env.pop(name, None)
    res = subprocess.run(
        ["bash", str(tree / "benchmarks" / "gpu" / "quality_chain.sh")],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return res, [line.split() for line in calls.read_text().splitlines()] if calls.exists() else []


def test_the_phases_run_in_order_each_within_its_budget(tmp_path: Path) -> None:
    res, calls = chain(tmp_path, CHAIN_S="5000", Q_DATA_S="300", Q_SPEC_S="560", Q_EYAS_S="500", Q_REST_S="420")
    assert res.returncode == 0, res.stdout + res.stderr
    # step, QPHASE, QTRAIN, BUDGET_S, the phase's OUT; the data phase trains nothing (QTRAIN empty)
    assert [c[1:] for c in calls] == [
        ["main", "300", "data"],
        ["main", "speculators", "560", "speculators"],
        ["main", "eyas", "500", "eyas"],
        ["rest", "(both)", "420", "rest"],
    ]
    assert {c[0] for c in calls} == {"quality"}
    # the data serve both trainers: eyas's store and speculators' copy
    assert set((tmp_path / "calls.data_for").read_text().split()) == {"speculators,eyas"}


def test_one_trainer_a_session(tmp_path: Path) -> None:
    res, calls = chain(tmp_path, CHAIN_S="5000", Q_TRAINERS="eyas")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c[-1] for c in calls] == ["data", "eyas", "rest"]
    # its data are eyas's store alone (no speculators' copy beside it)
    assert set((tmp_path / "calls.data_for").read_text().split()) == {"eyas"}


def test_a_trainer_that_is_none_is_named_before_anything_runs(tmp_path: Path) -> None:
    res, calls = chain(tmp_path, Q_TRAINERS="eyas eagle")
    assert res.returncode == 2 and "'eagle' is no trainer" in res.stdout
    assert calls == []


def test_a_failed_data_phase_ends_the_chain_and_a_failed_trainer_does_not(tmp_path: Path) -> None:
    res, calls = chain(tmp_path, FAIL="data")
    assert res.returncode == 1 and [c[-1] for c in calls] == ["data"]
    res, calls = chain(tmp_path, FAIL="speculators")
    assert "speculators ended with status 4" in res.stdout
    assert [c[-1] for c in calls] == ["data", "speculators", "eyas", "rest"]


def test_a_phase_gets_at_most_what_is_left_of_the_chain(tmp_path: Path) -> None:
    res, calls = chain(tmp_path, CHAIN_S="200", Q_DATA_S="300")
    budgets = [int(c[-2]) for c in calls]
    assert calls and all(150 <= b <= 200 for b in budgets), calls
    res, calls = chain(tmp_path, CHAIN_S="50")
    assert res.returncode == 1 and calls == [] and "data not started" in res.stdout
