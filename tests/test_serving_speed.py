"""Serving speed at every k and the best k (issue 31, item 3), on the CPU.

vLLM's worker is stood in for by tests/fake_vllm.py (its speeds are given); the timing loop of the
worker runs against a stand-in ``LLM``. Everything eyas does with them is its real code: the runs
per k, the one baseline, the report, resume."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import evalkit
import fake_vllm

# output tokens/s: (k, concurrent requests) -> with the draft; (None, c) -> without.
# At 1 request k=2 is best (1.9x); at 4 no k pays (k=1 is the least slow, 0.95x).
SPEEDS = {(None, 1): 100.0, (None, 4): 400.0,
          (1, 1): 150.0, (2, 1): 190.0, (3, 1): 170.0,
          (1, 4): 380.0, (2, 4): 360.0, (3, 4): 300.0}


# ------------------------------------------------------------------- the worker's timing loop


class _LLM:
    """``vllm.LLM.generate`` as the speed op calls it: records each wave's prompts; ``pause`` s a wave."""

    def __init__(self, pause: float):
        self.pause, self.waves = pause, []

    def generate(self, prompts, params, use_tqdm=False):
        self.waves.append([p["prompt_token_ids"][0] for p in prompts])
        time.sleep(self.pause)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * 4)]) for _ in prompts]


def test_a_speed_point_runs_at_least_its_waves_and_its_seconds():
    from eyas.vllm.worker.serve import speed

    req = {"op": "speed", "prompts": [[i] for i in range(5)], "max_tokens": 4, "concurrency": 2,
           "min_seconds": 0.0, "min_waves": 3}
    llm = _LLM(0.0)
    got = speed(llm, lambda **kw: kw, req)
    # an untimed warm-up wave, then 3 waves of 2, the prompts taken round and round
    assert llm.waves == [[0, 1], [0, 1], [2, 3], [4, 0]]
    assert (got["waves"], got["requests"], got["tokens"], got["concurrency"]) == (3, 6, 24, 2)

    llm = _LLM(0.02)
    got = speed(llm, lambda **kw: kw, {**req, "min_seconds": 0.2})
    assert got["seconds"] >= 0.2 and got["waves"] > 3 and got["waves"] == len(llm.waves) - 1
    assert got["tokens"] == 8 * got["waves"] and got["tokens_per_s"] == pytest.approx(got["tokens"] / got["seconds"])


# ----------------------------------------------------------- evaluate: every k, one baseline


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """(target, training work dir): a tiny target and a draft trained 2 steps by `eyas train`."""
    from eyas.target import resolve_target

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("serving")
    target = resolve_target(evalkit.make_eval_target(base / "target"))
    evalkit.train_draft(target, base / "work", steps=2, n=16)
    yield target, base / "work"
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def evaluated(drafted, tmp_path_factory):
    """`eyas evaluate --engine vllm -k 2 --also-k 1,3 --speed-concurrency 1,4` of that draft."""
    target, work = drafted
    base = tmp_path_factory.mktemp("serving-eval")
    qfile = evalkit.write_questions(base / "question.jsonl", 3)
    mp = pytest.MonkeyPatch()
    fake_vllm.use(mp, SPEEDS)
    try:
        yield _evaluate(target, work / "run" / "draft", qfile, base / "eval"), base / "eval", qfile
    finally:
        mp.undo()


def _evaluate(target, draft: Path, qfile: Path, out: Path, **settings):
    from eyas.evaluate.run import evaluate_draft

    opts = {"engine": "vllm", "k": 2, "also_k": [1, 3], "speed_concurrency": [1, 4], "speed_min_seconds": 0.5,
            "max_new_tokens": 8, "progress": False, **settings}
    return evaluate_draft(str(target.path), draft, qfile, out, **opts)


def test_evaluate_times_every_k_against_one_baseline_and_names_the_best_k(evaluated):
    from eyas.evaluate.report import summary_lines

    reports, out, _ = evaluated
    assert fake_vllm.STARTED == [2, None, 1, 3]  # an engine per k; the one without the draft once
    assert [(t["k"], t["concurrency"]) for t in fake_vllm.TIMED] == [
        (2, 1), (2, 4), (None, 1), (None, 4), (1, 1), (1, 4), (3, 1), (3, 4)]
    assert {(t["min_seconds"], t["min_waves"]) for t in fake_vllm.TIMED} == {(0.5, 3)}
    saved = json.loads((out / "vllm" / "report.json").read_text())
    assert saved["best_k"] == {"1": {"k": 2, "speedup": pytest.approx(1.9), "pays": True},
                               "4": {"k": 1, "speedup": pytest.approx(0.95), "pays": False}}
    rows = {(r["k"], r["concurrency"]): r for r in saved["serving_speed_by_k"]}
    assert sorted(rows) == [(k, c) for k in (1, 2, 3) for c in (1, 4)]
    assert rows[(3, 4)] == {"k": 3, "concurrency": 4, "tokens_per_s_draft": 300.0, "tokens_per_s_plain": 400.0,
                            "speedup": pytest.approx(0.75)}
    # every answer accepted whole by the stand-in: tau is k + 1 at each k
    assert saved["tau_by_k"] == {"1": pytest.approx(2.0), "2": pytest.approx(3.0), "3": pytest.approx(4.0)}
    assert reports["vllm"]["best_k"] == saved["best_k"]
    also_report = json.loads((out / "k3" / "vllm" / "report.json").read_text())
    assert "best_k" not in also_report  # named once, in the -k run's report, over every k
    also = also_report["serving_speed"]
    assert also["plain"] == saved["serving_speed"]["plain"] and also["plain_from"] == "the -k run"
    assert also["speedup"] == {"1": pytest.approx(1.7), "4": pytest.approx(0.75)}
    assert (also["min_seconds"], also["min_waves"]) == (0.5, 3)
    lines = summary_lines(reports, out)
    assert lines.count("vllm serving, 1 concurrent: best k=2, 1.90x") == 1
    assert any(line.startswith("vllm serving, 4 concurrent: no k speeds it up (the least slow: k=1, 0.95x)")
               for line in lines)
    assert "k=3 vllm serving, 4 concurrent: 300 tok/s with the draft, 400 without (0.75x)" in lines


def test_a_rerun_starts_no_engine_and_a_longer_minimum_times_again(drafted, evaluated, tmp_path, monkeypatch):
    target, work = drafted
    reports, first, qfile = evaluated
    out, draft = tmp_path / "eval", work / "run" / "draft"
    shutil.copytree(first, out)  # the records and speeds of the first run, resumed here
    fake_vllm.use(monkeypatch, SPEEDS)
    again = _evaluate(target, draft, qfile, out)
    assert fake_vllm.STARTED == [] and again["vllm"]["best_k"] == reports["vllm"]["best_k"]
    fake_vllm.use(monkeypatch, {**SPEEDS, (3, 1): 250.0})
    longer = _evaluate(target, draft, qfile, out, speed_min_seconds=1.0)
    assert fake_vllm.STARTED == [2, None, 1, 3]  # the answers are kept; the speed is timed again
    assert longer["vllm"]["best_k"]["1"] == {"k": 3, "speedup": pytest.approx(2.5), "pays": True}


def test_best_k_from_the_reports_of_each_k():
    """:func:`serving_summary` on the reports `build_report` makes: the highest ratio per
    concurrency, the smaller k on a tie, unpaid where none is above 1."""
    from eyas.evaluate.report import build_report, serving_summary

    def report(k, draft, plain):
        speed = {"draft": [{"concurrency": c, "tokens_per_s": t} for c, t in draft],
                 "plain": [{"concurrency": c, "tokens_per_s": t} for c, t in plain]}
        rec = {"category": "writing", "rounds": 2, "accepted_per_pos": [1] * k, "new_tokens": 4}
        return build_report([rec], k, {"engine": "vllm", "serving_speed": speed})

    plain = [(1, 100.0), (8, 500.0), (32, 1000.0)]
    got = serving_summary({3: report(3, [(1, 200.0), (8, 450.0), (32, 900.0)], plain),
                           5: report(5, [(1, 200.0), (8, 600.0), (32, 700.0)], plain),
                           1: report(1, [(1, 150.0), (8, 550.0), (32, None)], plain)})
    assert got["best_k"] == {"1": {"k": 3, "speedup": 2.0, "pays": True},
                             "8": {"k": 5, "speedup": 1.2, "pays": True},
                             "32": {"k": 3, "speedup": 0.9, "pays": False}}
    assert [(r["concurrency"], r["k"]) for r in got["serving_speed_by_k"]][:3] == [(1, 1), (1, 3), (1, 5)]
    assert got["tau_by_k"] == {"1": 1.5, "3": 2.5, "5": 3.5}
