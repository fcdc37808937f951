"""Serving speed at every k, the best k, and the export's model card (issue 31, item 3), on the CPU.

vLLM's worker is stood in for by tests/fake_vllm.py (its speeds are given); the timing loop of the
worker runs against a stand-in ``LLM``. Everything eyas does with them is its real code: the runs
per k, the one baseline, the report, resume, the card."""

from __future__ import annotations

import json
import shlex
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

import evalkit
import fake_vllm
from eyas.errors import EyasError

# output tokens/s: (k, concurrent requests) -> with the draft; (None, c) -> without.
# At 1 request k=2 is best (1.9x); at 4 no k pays (k=1 is the least slow, 0.95x).
SPEEDS = {
    (None, 1): 100.0,
    (None, 4): 400.0,
    (1, 1): 150.0,
    (2, 1): 190.0,
    (3, 1): 170.0,
    (1, 4): 380.0,
    (2, 4): 360.0,
    (3, 4): 300.0,
}


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

    req = {
        "op": "speed",
        "prompts": [[i] for i in range(5)],
        "max_tokens": 4,
        "concurrency": 2,
        "min_seconds": 0.0,
        "min_waves": 3,
    }
    llm = _LLM(0.0)
    got = speed(llm, lambda **kw: kw, req)
    # an untimed warm-up wave, then 3 waves of 2, the prompts taken round and round
    assert llm.waves == [[0, 1], [0, 1], [2, 3], [4, 0]]
    assert (got["waves"], got["requests"], got["tokens"], got["concurrency"]) == (3, 6, 24, 2)

    llm = _LLM(0.02)
    got = speed(llm, lambda **kw: kw, {**req, "min_seconds": 0.2})
    assert got["seconds"] >= 0.2 and got["waves"] > 3 and got["waves"] == len(llm.waves) - 1
    assert got["tokens"] == 8 * got["waves"] and got["tokens_per_s"] == pytest.approx(got["tokens"] / got["seconds"])


class _CountingLLM(_LLM):
    """With vLLM's spec-decode counters: each request's wave adds ``rounds`` verification rounds and
    ``accepted`` accepted draft tokens; the warm-up wave counts ``warmup`` times as much (a point's
    acceptance must leave it out)."""

    def __init__(self, rounds: int, accepted: int, warmup: int):
        super().__init__(0.0)
        self.rounds, self.accepted, self.warmup, self.count = rounds, accepted, warmup, [0, 0]

    def generate(self, prompts, params, use_tqdm=False):
        scale = self.warmup if not self.waves else 1
        self.count = [
            self.count[0] + scale * self.rounds * len(prompts),
            self.count[1] + scale * self.accepted * len(prompts),
        ]
        return super().generate(prompts, params, use_tqdm)

    def get_metrics(self):
        return [
            SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.count[0]),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=self.count[1]),
        ]


def test_a_speed_point_with_a_draft_has_the_acceptance_of_its_timed_waves():
    """The point's own tau (tokens per verification round) from vLLM's counters over the timed waves,
    the warm-up wave left out; none from an engine without a draft."""
    from eyas.vllm.worker.serve import speed

    req = {"op": "speed", "prompts": [[1], [2]], "max_tokens": 4, "concurrency": 2, "min_waves": 3}
    got = speed(_CountingLLM(rounds=4, accepted=6, warmup=5), lambda **kw: kw, req)
    assert got["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert "acceptance_length" not in speed(_LLM(0.0), lambda **kw: kw, req)
    assert "acceptance_length" not in speed(_CountingLLM(rounds=0, accepted=0, warmup=1), lambda **kw: kw, req)


class _Engine:
    """``LLM.llm_engine`` as the steady load drives it: a request of prompt ``[n]`` gains one token a
    step and finishes after ``n``; each step sleeps ``pause`` s and records how many requests it ran.
    ``get_metrics`` (the clock's start and end) marks the step it was read at."""

    def __init__(self, pause: float = 0.0):
        self.pause, self.live, self.added, self.batch, self.marks = pause, {}, [], [], []

    def add_request(self, rid, prompt, params):
        self.live[rid] = [prompt["prompt_token_ids"][0], 0]
        self.added.append(prompt["prompt_token_ids"][0])

    def step(self):
        self.batch.append(len(self.live))
        time.sleep(self.pause)
        outs = []
        for rid, st in list(self.live.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(
                SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=[7] * st[1])])
            )
            if done:
                del self.live[rid]
        return outs

    def has_unfinished_requests(self):
        return bool(self.live)

    def get_num_unfinished_requests(self):
        return len(self.live)


class _SteadyLLM:
    def __init__(self, pause: float = 0.0):
        self.llm_engine = _Engine(pause)

    def generate(self, prompts, params, use_tqdm=False):
        for i, p in enumerate(prompts):
            self.llm_engine.add_request(f"w{i}", p, params)
        outs = {}
        while self.llm_engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in self.llm_engine.step() if o.finished})
        return [outs[f"w{i}"] for i in range(len(prompts))]

    def get_metrics(self):
        self.llm_engine.marks.append(len(self.llm_engine.batch))
        return []


def test_a_steady_point_keeps_its_requests_in_flight_and_counts_the_timed_steps():
    """steady: every step before the last requests drain runs `concurrency` requests, the prompts
    in turn; the point counts the tokens of exactly the steps between the clock's start and end,
    and at least min_waves x concurrency requests finish in them; the engine is left empty."""
    from eyas.vllm.worker.serve import speed

    req = {"op": "speed", "prompts": [[2], [5], [3], [9]], "max_tokens": 16, "concurrency": 3, "min_waves": 2}
    llm = _SteadyLLM()
    got = speed(llm, lambda **kw: kw, {**req, "load": "steady"})
    eng = llm.llm_engine
    start, end = eng.marks
    assert eng.added == [[2, 5, 3, 9][i % 4] for i in range(len(eng.added))]
    assert set(eng.batch[:end]) == {3} and not eng.live
    assert got["tokens"] == 3 * (end - start)  # one token per request per step
    assert got["requests"] >= 6 and got["concurrency"] == 3 and got["waves"] == got["requests"] // 3


def test_steady_load_is_not_held_up_by_the_slowest_request_of_a_wave():
    """With answers of 1 and 8 tokens, a wave lasts 8 steps for 9 tokens, while steady keeps 2
    requests running: more tokens per step, at the same time per step."""
    from eyas.vllm.worker.serve import speed

    req = {"op": "speed", "prompts": [[1], [8]], "max_tokens": 8, "concurrency": 2, "min_waves": 4}
    steady = _SteadyLLM(pause=0.002)
    waves = _SteadyLLM(pause=0.002)
    got_s = speed(steady, lambda **kw: kw, {**req, "load": "steady"})
    got_w = speed(waves, lambda **kw: kw, {**req, "load": "waves"})
    per_step_w = got_w["tokens"] / (waves.llm_engine.marks[1] - waves.llm_engine.marks[0])
    per_step_s = got_s["tokens"] / (steady.llm_engine.marks[1] - steady.llm_engine.marks[0])
    assert per_step_w == pytest.approx(9 / 8) and per_step_s == pytest.approx(2.0)
    assert got_s["tokens_per_s"] > 1.4 * got_w["tokens_per_s"]


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
    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    opts = {
        "engine": "vllm",
        "k": 2,
        "also_k": [1, 3],
        "speed_concurrency": [1, 4],
        "speed_min_seconds": 0.5,
        "max_new_tokens": 8,
        "progress": False,
        **settings,
    }
    return evaluate(EvaluateConfig(target=str(target.path), draft=draft, prompts=qfile, out=out, **opts))


def test_evaluate_times_every_k_against_one_baseline_and_names_the_best_k(evaluated):
    from eyas.evaluate.report import summary_lines

    reports, out, _ = evaluated
    assert fake_vllm.STARTED == [2, None, 1, 3]  # an engine per k; the one without the draft once
    assert [(t["k"], t["concurrency"]) for t in fake_vllm.TIMED] == [
        (2, 1),
        (2, 4),
        (None, 1),
        (None, 4),
        (1, 1),
        (1, 4),
        (3, 1),
        (3, 4),
    ]
    assert {(t["min_seconds"], t["min_waves"]) for t in fake_vllm.TIMED} == {(0.5, 3)}
    saved = json.loads((out / "vllm" / "report.json").read_text())
    assert saved["gpu"] == fake_vllm.GPU  # the engine's GPU, which the benchmark table records
    assert saved["best_k"] == {
        "1": {"k": 2, "speedup": pytest.approx(1.9), "pays": True},
        "4": {"k": 1, "speedup": pytest.approx(0.95), "pays": False},
    }
    rows = {(r["k"], r["concurrency"]): r for r in saved["serving_speed_by_k"]}
    assert sorted(rows) == [(k, c) for k in (1, 2, 3) for c in (1, 4)]
    assert rows[(3, 4)] == {
        "k": 3,
        "concurrency": 4,
        "tokens_per_s_draft": 300.0,
        "tokens_per_s_plain": 400.0,
        "speedup": pytest.approx(0.75),
        "tau_timed": 4.0,  # the timed requests' own, as the stand-in accepts every draft
    }
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
    assert any(
        line.startswith("vllm serving, 4 concurrent: no k speeds it up (the least slow: k=1, 0.95x)") for line in lines
    )
    assert "k=3 vllm serving, 4 concurrent: 300 tok/s with the draft, 400 without (0.75x)" in lines
    # the baseline's engine answers every question once; each k's answers are compared with those
    # (the stand-in without the draft differs at the 4th token of every second turn)
    assert (out / "vllm" / "plain-answers.jsonl").is_file()
    for rep in (saved, also_report):
        assert rep["greedy_vs_plain"] == {
            "turns": 6,
            "identical": 3,
            "first_turns": 3,
            "first_turns_identical": 3,
            "first_difference_median": 3,
        }
    assert "k=2 vllm greedy answers identical with and without the draft: 3/6 turns (3/3 first turns)" in lines


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


def test_a_k_resumed_on_another_gpu_times_its_own_baseline(drafted, evaluated, tmp_path, monkeypatch):
    """A run stopped after its -k run and resumed on a machine with another GPU: the later k do not
    compare their speed with the first GPU's baseline but time one on theirs; a k resumed on the
    same GPU keeps sharing it."""
    target, work = drafted
    reports, first, qfile = evaluated
    out, draft = tmp_path / "eval", work / "run" / "draft"
    shutil.copytree(first, out)
    shutil.rmtree(out / "k1")
    shutil.rmtree(out / "k3")
    first_gpu = reports["vllm"]["gpu"]
    fake_vllm.use(monkeypatch, SPEEDS)
    monkeypatch.setattr(fake_vllm, "GPU", "Other GPU 1")
    again = _evaluate(target, draft, qfile, out)
    assert fake_vllm.STARTED == [1, None, 3, None]  # each later k with a baseline of its own
    k1 = again["k1"]["vllm"]["serving_speed"]
    assert "plain_from" not in k1 and {p["gpu"] for p in k1["draft"] + k1["plain"]} == {"Other GPU 1"}
    assert {p["gpu"] for p in again["vllm"]["serving_speed"]["plain"]} == {first_gpu}  # the -k run's own
    shutil.rmtree(out / "k3")
    fake_vllm.use(monkeypatch, SPEEDS)
    monkeypatch.setattr(fake_vllm, "GPU", first_gpu)  # back on the -k run's GPU
    _evaluate(target, draft, qfile, out)
    assert fake_vllm.STARTED == [3]  # its baseline shared again


def test_each_engine_start_and_speed_point_is_reported_as_it_ends(drafted, tmp_path, monkeypatch, capsys):
    """With --progress, a line per vLLM engine started and per serving-speed point: a vLLM
    evaluation's minutes are accounted for while it runs; --quiet prints none."""
    target, work = drafted
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 1)
    fake_vllm.use(monkeypatch, SPEEDS)
    _evaluate(target, work / "run" / "draft", qfile, tmp_path / "eval", also_k=[3], progress=True)
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("vllm engine")] == [
        "vllm engine (k=2) ready in 0.0 s",
        "vllm engine (no draft) ready in 0.0 s",
        "vllm engine (k=3) ready in 0.0 s",
    ]
    points = [line.split(" over ")[0] for line in err if line.startswith("vllm serving, ")]
    assert points == [
        "vllm serving, k=2, 1 requests (steady): 190 tokens/s",
        "vllm serving, k=2, 4 requests (steady): 360 tokens/s",
        "vllm serving, no draft, 1 requests (steady): 100 tokens/s",
        "vllm serving, no draft, 4 requests (steady): 400 tokens/s",
        "vllm serving, k=3, 1 requests (steady): 170 tokens/s",
        "vllm serving, k=3, 4 requests (steady): 300 tokens/s",
    ]
    _evaluate(target, work / "run" / "draft", qfile, tmp_path / "quiet", also_k=[3], progress=False)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("vllm ")]


def test_a_run_stopped_while_timing_the_baseline_resumes_without_the_drafts_engine(
    drafted, evaluated, tmp_path, monkeypatch
):
    """The draft's answers and speed points are kept before the engine without the draft starts: a
    run stopped there (a time limit) starts only that engine again, and ends as an uninterrupted one."""
    target, work = drafted
    reports, _, qfile = evaluated
    out, draft = tmp_path / "eval", work / "run" / "draft"
    fake_vllm.use(monkeypatch, {key: v for key, v in SPEEDS.items() if key[0] is not None})
    with pytest.raises(KeyError):  # the baseline's engine fails at its first point
        _evaluate(target, draft, qfile, out)
    assert fake_vllm.STARTED == [2, None]
    fake_vllm.use(monkeypatch, SPEEDS)
    again = _evaluate(target, draft, qfile, out)
    assert fake_vllm.STARTED == [None, 1, 3]  # k=2's engine is not started again
    assert [t["k"] for t in fake_vllm.TIMED] == [None, None, 1, 1, 3, 3]
    assert again["vllm"]["serving_speed_by_k"] == reports["vllm"]["serving_speed_by_k"]
    assert again["vllm"]["best_k"] == reports["vllm"]["best_k"]


def test_the_time_a_later_k_is_given_leaves_out_the_baseline(drafted, evaluated, tmp_path, monkeypatch):
    """Under EYAS_STOP_AT a further k starts only if a part like the longest so far fits; the -k
    run's engine without the draft is not such a part (the later k reuse its speed and answers), so a
    slow baseline does not keep the next k from starting."""
    from eyas import deadline

    target, work = drafted
    _, _, qfile = evaluated
    fake_vllm.use(monkeypatch, SPEEDS)
    fake_vllm.START_SECONDS[None] = 3.0  # the baseline's engine: slower than all else in this run
    needs = []
    monkeypatch.setattr(deadline, "check", lambda need_s, what: needs.append((what, need_s)))
    reps = _evaluate(target, work / "run" / "draft", qfile, tmp_path / "eval")
    assert [what for what, _ in needs] == ["k=1", "k=3"]
    assert all(0 < need < 3.0 for _, need in needs), needs
    assert reps["vllm"]["plain_seconds_this_run"] >= 3.0
    assert reps["k1"]["vllm"]["plain_seconds_this_run"] == 0.0  # the later k start no baseline


def test_speculative_options_reach_the_engine_the_report_and_the_card(drafted, evaluated, tmp_path, monkeypatch):
    """--speculative-options: every draft engine gets them (the one without the draft does not), the
    records of the default run are not mixed with them, the report records them and the export's
    serve line carries them next to the best k."""
    from eyas.export.cli import register

    target, work = drafted
    _, first, qfile = evaluated
    out, draft = tmp_path / "eval", work / "run" / "draft"
    fake_vllm.use(monkeypatch, SPEEDS)
    options = {"enforce_eager": True, "disable_padded_drafter_batch": True}
    shutil.copytree(first, tmp_path / "default")
    with pytest.raises(EyasError, match="speculative_options differ"):
        _evaluate(target, draft, qfile, tmp_path / "default", speculative_options=options)
    fake_vllm.use(monkeypatch, SPEEDS)
    reports = _evaluate(target, draft, qfile, out, speculative_options=options)
    assert fake_vllm.STARTED == [2, None, 1, 3]
    assert fake_vllm.OPTIONS == [options, {}, options, options]
    saved = json.loads((out / "vllm" / "report.json").read_text())
    assert saved["speculative_options"] == options and reports["vllm"]["recommended_k"]["k"] == 1
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(
        app,
        [
            "export",
            str(_card_draft(drafted, tmp_path)),
            "--out",
            str(tmp_path / "exp"),
            "--speed-report",
            str(out / "vllm" / "report.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    config = json.loads(_serve_line((tmp_path / "exp" / "README.md").read_text())[4])
    assert config == {
        "method": "eagle3",
        "model": str((tmp_path / "exp").resolve()),
        "num_speculative_tokens": 1,
        **options,
    }


def test_speculative_options_eyas_sets_itself_are_refused(tmp_path):
    from eyas.cli import app

    res = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--draft",
            str(tmp_path),
            "--engine",
            "vllm",
            "--speculative-options",
            "enforce_eager=true,model=x",
        ],
    )
    assert res.exit_code != 0 and "--speculative-options model: eyas sets these itself" in str(res.exception)
    res = CliRunner().invoke(app, ["evaluate", "--draft", str(tmp_path), "--speculative-options", "enforce_eager"])
    assert res.exit_code != 0 and "expected key=value pairs" in res.output + str(res.exception)


def test_best_k_from_the_reports_of_each_k():
    """:func:`serving_summary` on the reports `build_report` makes: the highest ratio per
    concurrency, the smaller k on a tie, unpaid where none is above 1."""
    from eyas.evaluate.report import build_report, serving_summary

    def report(k, draft, plain):
        speed = {
            "draft": [{"concurrency": c, "tokens_per_s": t} for c, t in draft],
            "plain": [{"concurrency": c, "tokens_per_s": t} for c, t in plain],
        }
        rec = {"category": "writing", "rounds": 2, "accepted_per_pos": [1] * k, "new_tokens": 4}
        return build_report([rec], k, {"engine": "vllm", "serving_speed": speed})

    plain = [(1, 100.0), (8, 500.0), (32, 1000.0)]
    got = serving_summary(
        {
            3: report(3, [(1, 200.0), (8, 450.0), (32, 900.0)], plain),
            5: report(5, [(1, 200.0), (8, 600.0), (32, 700.0)], plain),
            1: report(1, [(1, 150.0), (8, 550.0), (32, None)], plain),
        }
    )
    assert got["best_k"] == {
        "1": {"k": 3, "speedup": 2.0, "pays": True},
        "8": {"k": 5, "speedup": 1.2, "pays": True},
        "32": {"k": 3, "speedup": 0.9, "pays": False},
    }
    assert [(r["concurrency"], r["k"]) for r in got["serving_speed_by_k"]][:3] == [(1, 1), (1, 3), (1, 5)]
    assert got["tau_by_k"] == {"1": 1.5, "3": 2.5, "5": 3.5}


def _rows(speedups, ratios=None):
    """serving_speed_by_k rows from {k: {concurrency: speedup}} (plain 100 tokens/s) and {k: host ratio}."""
    return [
        {
            "k": k,
            "concurrency": c,
            "tokens_per_s_draft": None if x is None else 100.0 * x,
            "tokens_per_s_plain": 100.0,
            "speedup": x,
            **({"host_probe_ratio": ratios[k]} if ratios and k in ratios else {}),
        }
        for k, by_c in speedups.items()
        for c, x in by_c.items()
    ]


def test_the_recommended_k_is_the_fastest_at_its_slowest_load():
    """A longer draft can win at 1 request and lose in a full batch (as in the Qwen rows of
    benchmarks/serving_speed.json): one serve line meets every load, so eyas recommends the k whose
    worst concurrency is best, not the best k at 1 request."""
    from eyas.evaluate.report import recommended_k

    rows = _rows({3: {1: 1.48, 32: 1.52}, 4: {1: 1.52, 32: 1.06}, 5: {1: 1.19, 32: 0.95}})
    assert recommended_k(rows) == {
        "k": 3,
        "speedup": {"1": 1.48, "32": 1.52},
        "worst": 1.48,
        "pays": True,
        "host_speeds_mixed": False,
    }
    # on a tie the smaller k; a k without a speedup at every concurrency is not a candidate
    assert recommended_k(_rows({2: {1: 1.3, 8: 1.2}, 1: {1: 1.2, 8: 1.3}, 3: {1: 2.0, 8: None}}))["k"] == 1
    # where every k slows some load down, the least slow is named, unpaid
    got = recommended_k(_rows({1: {1: 1.5, 4: 0.95}, 2: {1: 1.9, 4: 0.9}}))
    assert (got["k"], got["pays"]) == (1, False)
    assert recommended_k(_rows({3: {1: None}})) is None


def test_speedups_timed_at_two_host_speeds_are_named():
    """Each k's host probe ratio travels with its rows; the k outside the bounds are named, and a
    recommended k among them says so (its speedup may be the host's, not the draft's)."""
    from eyas.evaluate.report import recommended_k, recommended_k_lines

    rows = _rows({3: {1: 1.48, 32: 1.52}, 4: {1: 1.52, 32: 1.06}}, {3: 1.17, 4: 0.78})
    report = {"serving_speed_by_k": rows, "recommended_k": recommended_k(rows)}
    assert not report["recommended_k"]["host_speeds_mixed"]
    lines = recommended_k_lines(report["recommended_k"], rows)
    assert lines[0] == "vllm serving: serve with k=3, the best at its slowest load (1.48x at 1, 1.52x at 32 concurrent)"
    assert lines[1].startswith("vllm serving: timed at two host speeds (host probe ratio k=4 0.78, outside 0.83-1.20)")
    flagged = recommended_k(_rows({3: {1: 1.48, 32: 1.52}}, {3: 1.3}))
    assert (
        flagged["host_speeds_mixed"]
        and "k=3 1.30" in recommended_k_lines(flagged, _rows({3: {1: 1.48, 32: 1.52}}, {3: 1.3}))[1]
    )


def test_a_failed_profile_keeps_the_serving_speed(drafted, tmp_path, monkeypatch):
    """A profile that yields no trace (here: the stand-in writes none) is recorded as an error, with
    a warning; the speed points it was to explain are kept, and the run ends."""
    target, work = drafted
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 2)
    fake_vllm.use(monkeypatch, SPEEDS)
    with pytest.warns(UserWarning, match="vllm profile .* failed, the serving speed is kept"):
        reps = _evaluate(target, work / "run" / "draft", qfile, tmp_path / "eval", also_k=[], speed_profile_steps=4)
    speed = reps["vllm"]["serving_speed"]
    assert fake_vllm.PROFILED == [2, None]  # the draft's engine, then the baseline's
    assert [p["concurrency"] for p in speed["draft"]] == [p["concurrency"] for p in speed["plain"]] == [1, 4]
    assert speed["profile_steps"] == 4
    for key in ("draft_profile", "plain_profile"):
        assert "no vLLM trace with decoding steps" in speed[key]["error"]


def test_each_k_s_step_profile_is_gathered_and_printed(tmp_path):
    """--speed-profile-steps: each k's profiled step (and the baseline's, from the -k run) side by
    side in the summary, and a line each in what `eyas evaluate` prints."""
    from eyas.evaluate.report import build_report, serving_summary, summary_lines

    def prof(interval, **parts):
        return {"steps": 10, "interval_ms": interval, "parts_ms": parts, "rest_ms": 0.1, "tokens_per_step": 4}

    def report(k, draft_profile, plain_profile=None):
        speed = {
            "draft": [{"concurrency": 1, "tokens_per_s": 200.0}],
            "plain": [{"concurrency": 1, "tokens_per_s": 100.0}],
            "draft_profile": draft_profile,
            **({"plain_profile": plain_profile} if plain_profile else {}),
        }
        rec = {"category": "writing", "rounds": 2, "accepted_per_pos": [1] * k, "new_tokens": 4}
        return build_report([rec], k, {"engine": "vllm", "serving_speed": speed})

    plain = prof(2.1, forward=1.5)
    reps = {3: report(3, prof(3.5, forward=1.9, draft=0.9), plain), 5: report(5, prof(4.9, forward=2.0, draft=1.8))}
    got = serving_summary(reps)["step_profile"]
    assert got["plain"] == plain
    assert got["by_k"]["3"]["parts_ms"]["draft"] == 0.9 and got["by_k"]["5"]["interval_ms"] == 4.9
    lines = summary_lines({"vllm": reps[3]}, tmp_path)
    assert any("with the draft" in x and "a step every 3.50 ms" in x and "draft 0.90" in x for x in lines)
    assert any("no draft" in x and "a step every 2.10 ms" in x for x in lines)
    # without profiles the summary has none
    del reps[3]["serving_speed"]["draft_profile"], reps[3]["serving_speed"]["plain_profile"]
    del reps[5]["serving_speed"]["draft_profile"]
    assert "step_profile" not in serving_summary(reps)


# --------------------------------------------------------------------------- the model card


def _card_draft(drafted, tmp_path) -> Path:
    """A copy of the trained run (its train_config.json names the prepared data), so a test can add
    a tau.json beside the draft."""
    _, work = drafted
    shutil.copytree(work / "run", tmp_path / "run")
    return tmp_path / "run" / "draft"


def _serve_line(card: str) -> list[str]:
    line = next(x for x in card.splitlines() if x.startswith("vllm serve "))
    return shlex.split(line)


def test_the_card_of_an_export_without_tau_or_speed(drafted, tmp_path):
    from eyas.export.config import ExportConfig
    from eyas.export.run import run as run_export

    target, work = drafted
    draft = _card_draft(drafted, tmp_path)
    out = run_export(
        ExportConfig(ckpt=draft, format="vllm", out=tmp_path / "exp", target=None, num_speculative_tokens=4)
    )
    card = (out / "README.md").read_text()
    assert card.startswith(f"# EAGLE-3 draft for {target.path}\n")
    assert f"- eyas target id: `{target.id}`" in card
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert (
        f"- prepared dataset `{work / 'data'}` (id `{manifest['id']}`): 16 conversations, "
        f"{manifest['counts']['trained_tokens']:,} trained-on tokens"
    ) in card
    assert "- trained 2 steps," in card
    assert "Not measured: no tau.json beside the draft" in card
    assert "## Serving speed (vLLM, output tokens/s)\n\nNot measured: `eyas evaluate --engine vllm" in card
    args = _serve_line(card)
    assert args[:4] == ["vllm", "serve", str(target.path), "--speculative-config"]
    # the keys eyas's own vLLM worker passes as speculative_config
    assert json.loads(args[4]) == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 4}
    assert "k = 4: the export's num_speculative_tokens" in card


def test_the_card_with_tau_and_the_measured_speedups(drafted, evaluated, tmp_path):
    from eyas.export.cli import register
    from eyas.train.tau import TAU_FILE

    _, out_eval, _ = evaluated
    draft = _card_draft(drafted, tmp_path)
    (draft / TAU_FILE).write_text(
        json.dumps(
            {
                "step": 2,
                "tau": {"1": 1.25, "3": 1.5, "5": 1.75},
                "turns": 6,
                "questions": 3,
                "prompts": "q.jsonl",
                "max_new_tokens": 8,
            }
        )
    )
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    report = out_eval / "vllm" / "report.json"
    res = CliRunner().invoke(
        app, ["export", str(draft), "--out", str(tmp_path / "exp"), "-k", "4", "--speed-report", str(report)]
    )
    assert res.exit_code == 0, res.output
    card = (tmp_path / "exp" / "README.md").read_text()
    # tau per k: while training (tau.json) and in evaluate (vLLM), "not measured" where one has no k
    assert "| 1 | 1.25 | 2.00 |" in card and "| 2 | not measured | 3.00 |" in card
    assert "| 5 | 1.75 | not measured |" in card
    assert "While training: greedy, at step 2, on 6 turns of q.jsonl, 8 new tokens each." in card
    assert "| 1 | 2 | 190 | 100 | 1.90x |" in card and "| 4 | 3 | 300 | 400 | 0.75x |" in card
    assert "- 1 concurrent: best k = 2, 1.90x" in card
    assert "- 4 concurrent: no k speeds serving up (the least slow: k = 1, 0.95x)" in card
    assert f"; report {report}." in card
    assert f"with vLLM fake-0.0 on {fake_vllm.GPU}, " in card  # the GPU the speeds were timed on
    # served with k=1: k=2 is the best at 1 request (1.90x) but slows 4 requests more (0.90x against 0.95x)
    assert json.loads(_serve_line(card)[4])["num_speculative_tokens"] == 1
    assert "k = 1: of the k measured, the fastest at its slowest load (1.50x at 1, 0.95x at 4 concurrent" in card
    assert "- serve with k=1, the best at its slowest load (1.50x at 1, 0.95x at 4 concurrent)" in card
    # k=2 at 1 request: a 1000 * 3.00 / 190 = 15.79 ms step against plain's 10 ms needs tau 1.58
    assert "Where a step's time goes" in card and "k=2 1.58 (has 3.00)" in card
    # a report written before eyas named the recommended k: the card makes it from the rows
    old = {k: v for k, v in json.loads(report.read_text()).items() if k != "recommended_k"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    res = CliRunner().invoke(
        app, ["export", str(draft), "--out", str(tmp_path / "exp2"), "--speed-report", str(tmp_path / "old.json")]
    )
    assert res.exit_code == 0, res.output
    again = (tmp_path / "exp2" / "README.md").read_text()
    assert json.loads(_serve_line(again)[4])["num_speculative_tokens"] == 1
    assert "- serve with k=1, the best at its slowest load" in again


def _cut_during_k3(out_eval: Path, cut: Path, *drop: str) -> Path:
    """A copy of the evaluation ``out_eval`` in ``cut`` as a run stopped during k=3 leaves it: no
    k3/, and OUT/vllm/report.json without the summary written at the end (nor the keys ``drop``).
    Returns that report's path."""
    shutil.copytree(out_eval, cut)
    shutil.rmtree(cut / "k3")
    rep_path = cut / "vllm" / "report.json"
    rep = json.loads(rep_path.read_text())
    for key in ("serving_speed_by_k", "best_k", "recommended_k", "tau_by_k", "step_cost", *drop):
        rep.pop(key)
    rep_path.write_text(json.dumps(rep))
    return rep_path


def test_the_card_of_a_run_stopped_between_two_k_has_every_k_it_timed(drafted, evaluated, tmp_path):
    """An evaluation cut before its last k has no summary in OUT/vllm/report.json yet: the card
    takes the k timed beside it (OUT/k<N>/), not the -k run's alone, as `eyas evaluate` would have."""
    from eyas.export.config import ExportConfig
    from eyas.export.run import run as run_export

    _, out_eval, _ = evaluated
    cut = tmp_path / "eval"
    rep_path = _cut_during_k3(out_eval, cut)
    stale = cut / "k4" / "vllm"  # a k of an earlier evaluation on other prompts, left in OUT
    stale.mkdir(parents=True)
    other = json.loads((cut / "k1" / "vllm" / "report.json").read_text())
    (stale / "report.json").write_text(json.dumps({**other, "num_speculative_tokens": 4, "prompts": "other.jsonl"}))
    whole = json.loads((out_eval / "vllm" / "report.json").read_text())["serving_speed_by_k"]
    draft = _card_draft(drafted, tmp_path)
    run_export(ExportConfig(ckpt=draft, out=tmp_path / "exp", speed_report=rep_path))
    card = (tmp_path / "exp" / "README.md").read_text()
    for r in whole:
        line = f"| {r['concurrency']} | {r['k']} | {r['tokens_per_s_draft']:,.0f} |"
        assert (line in card) == (r["k"] != 3), line
    assert "| 1 | not measured | 2.00 |" in card and "| 3 |" not in card.split("## Serving speed")[0]
    # the other prompts' k is not mixed in: no tau row and no speed row of k=4
    tau_part, speed_part = card.split("## Serving speed")
    assert "\n| 4 |" not in tau_part and not any(f"| {c} | 4 |" in speed_part for c in (1, 4))


def test_a_speed_report_of_another_draft_or_without_speed_is_refused(drafted, evaluated, tmp_path):
    from eyas.export.config import ExportConfig
    from eyas.export.run import run as run_export

    _, out_eval, _ = evaluated
    draft = _card_draft(drafted, tmp_path)
    rep = json.loads((out_eval / "vllm" / "report.json").read_text())
    cases = {
        "another draft": {**rep, "draft_sha256": "0" * 64},
        "no serving speed": {**rep, "serving_speed": None},
        "not the vllm engine's report": {**rep, "engine": "builtin"},
    }
    for i, (message, bad) in enumerate(cases.items()):
        path = tmp_path / f"report{i}.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(EyasError, match=message):
            run_export(
                ExportConfig(ckpt=draft, format="vllm", out=tmp_path / f"exp{i}", target=None, speed_report=path)
            )
        assert not (tmp_path / f"exp{i}").exists()  # refused before anything is written


def test_the_benchmark_table_takes_the_rows_of_each_targets_run(evaluated, tmp_path):
    """scripts/serving_speed.py: benchmarks/serving_speed.json's rows are the reports' own; a target
    measured again replaces its rows."""
    import subprocess
    import sys

    _, out_eval, _ = evaluated
    table = tmp_path / "serving_speed.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "serving_speed.py"
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, str(script), "--out", str(table), str(out_eval)], capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr
    got = json.loads(table.read_text())
    rep = json.loads((out_eval / "vllm" / "report.json").read_text())
    target = rep["target_name"]
    assert got["rows"] == [{"target": target, **r} for r in rep["serving_speed_by_k"]]  # once, not twice
    assert got["best_k"] == {target: rep["best_k"]}
    assert got["recommended_k"] == {target: rep["recommended_k"]} and rep["recommended_k"]["k"] == 1
    assert got["runs"][target]["min_waves"] == 3 and got["runs"][target]["min_seconds"] == 0.5


def test_the_benchmark_table_keeps_the_ks_of_a_run_cut_short(evaluated, tmp_path):
    """A run stopped after some k (no summary in OUT/vllm/report.json yet) gives the rows of the k it
    finished, the same as the full run's for those k, and says which k it has."""
    import subprocess
    import sys

    _, out_eval, _ = evaluated
    cut = tmp_path / "eval"
    rep_path = _cut_during_k3(out_eval, cut, "gpu")
    table = tmp_path / "serving_speed.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "serving_speed.py"
    gpu = "NVIDIA H100 80GB HBM3"  # the report, written on a CPU, names no GPU: --gpu says which timed it
    res = subprocess.run(
        [sys.executable, str(script), "--out", str(table), "--gpu", gpu, str(cut)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(table.read_text())
    whole = json.loads((out_eval / "vllm" / "report.json").read_text())
    target = whole["target_name"]
    assert got["rows"] == [{"target": target, **r} for r in whole["serving_speed_by_k"] if r["k"] != 3]
    assert got["runs"][target]["partial"] == {"k_measured": [1, 2]} and got["runs"][target]["gpu"] == gpu
    named = {**json.loads(rep_path.read_text()), "gpu": "NVIDIA H200"}  # a report that names its GPU is not overruled
    rep_path.write_text(json.dumps(named))
    res = subprocess.run(
        [sys.executable, str(script), "--out", str(table), "--gpu", gpu, str(cut)], capture_output=True, text=True
    )
    assert res.returncode != 0 and "NVIDIA H200" in res.stderr
    assert got["best_k"][target]["1"]["k"] == 2  # k=3 not measured; k=2 was the best anyway


def test_step_cost_splits_a_step_into_its_fixed_part_and_the_drafts():
    """Serving speeds made from a known cost model (a plain step of 10 ms; a speculative one of
    12 ms + 1.5 ms per draft token) give that model back, and the tau each k needs to pay."""
    from eyas.evaluate.report import build_report, serving_summary
    from eyas.evaluate.step_cost import step_cost_lines

    plain_ms, fixed_ms, per_tok_ms, c = 10.0, 12.0, 1.5, 4
    taus = {1: 1.6, 2: 2.0, 4: 2.4}

    def report(k):
        step_ms = fixed_ms + per_tok_ms * k
        speed = {
            "draft": [{"concurrency": c, "tokens_per_s": 1000.0 * c * taus[k] / step_ms}],
            "plain": [{"concurrency": c, "tokens_per_s": 1000.0 * c / plain_ms}],
        }
        # rounds and accepted chosen so that the pooled tau is taus[k]
        rec = {"category": "writing", "rounds": 10, "accepted_per_pos": [round((taus[k] - 1) * 10)] + [0] * (k - 1)}
        return build_report([{**rec, "new_tokens": 1}], k, {"engine": "vllm", "serving_speed": speed})

    cost = serving_summary({k: report(k) for k in taus})["step_cost"][str(c)]
    assert cost["plain_step_ms"] == pytest.approx(plain_ms)
    assert cost["fixed_ms"] == pytest.approx(fixed_ms)
    assert cost["per_draft_token_ms"] == pytest.approx(per_tok_ms)
    need = {s["k"]: s["breakeven_tau"] for s in cost["by_k"]}
    assert need == {k: pytest.approx((fixed_ms + per_tok_ms * k) / plain_ms) for k in taus}
    (line,) = step_cost_lines({str(c): cost})
    assert "12.00 ms + 1.50 ms per draft token" in line and "k=1 1.35 (has 1.60)" in line


def test_step_cost_takes_the_tau_of_the_timed_requests():
    """Where a speed point carries its own tau (the timed first turns), a step's time comes from it,
    not from the acceptance pass's tau over other prompts: the known cost model comes back only so."""
    from eyas.evaluate.report import build_report, serving_summary

    plain_ms, fixed_ms, per_tok_ms, c = 2.0, 1.5, 0.5, 1
    timed = {2: 1.9, 3: 2.1}  # the speed prompts' tau
    passed = {2: 2.2, 3: 2.5}  # the acceptance pass's, on all turns

    def report(k):
        step_ms = fixed_ms + per_tok_ms * k
        point = {"concurrency": c, "tokens_per_s": 1000.0 * c * timed[k] / step_ms, "acceptance_length": timed[k]}
        speed = {"draft": [point], "plain": [{"concurrency": c, "tokens_per_s": 1000.0 * c / plain_ms}]}
        rec = {"category": "writing", "rounds": 10, "accepted_per_pos": [round((passed[k] - 1) * 10)] + [0] * (k - 1)}
        return build_report([{**rec, "new_tokens": 1}], k, {"engine": "vllm", "serving_speed": speed})

    summary = serving_summary({k: report(k) for k in timed})
    cost = summary["step_cost"][str(c)]
    assert cost["fixed_ms"] == pytest.approx(fixed_ms) and cost["per_draft_token_ms"] == pytest.approx(per_tok_ms)
    assert [(s["tau"], s["tau_from"]) for s in cost["by_k"]] == [(1.9, "timed requests"), (2.1, "timed requests")]
    assert summary["tau_by_k"] == {"2": pytest.approx(2.2), "3": pytest.approx(2.5)}
    assert [r["tau_timed"] for r in summary["serving_speed_by_k"]] == [1.9, 2.1]


def test_step_cost_without_two_k_has_no_line_fit():
    from eyas.evaluate.step_cost import step_costs

    rows = [{"k": 3, "concurrency": 1, "tokens_per_s_draft": 300.0, "tokens_per_s_plain": 200.0}]
    got = step_costs(rows, {"3": 2.0})["1"]
    assert "fixed_ms" not in got and got["by_k"][0]["breakeven_tau"] == pytest.approx((1000 * 2 / 300) / 5)
    assert step_costs(rows, {}) == {}  # no tau for that k: nothing to say


def test_greedy_vs_plain_counts_identical_turns_and_where_the_others_differ():
    from eyas.evaluate.report import greedy_vs_plain

    records = [
        {"question_id": 1, "turn": 0, "output_ids": [5, 6, 7]},
        {"question_id": 1, "turn": 1, "output_ids": [5, 6, 7, 8]},
        {"question_id": 2, "turn": 0, "output_ids": [5, 9, 9]},
        {"question_id": 3, "turn": 0, "output_ids": [1, 2]},  # no plain answer: not compared
    ]
    plain = {"1/0": [5, 6, 7], "1/1": [5, 6, 7], "2/0": [5, 6, 6]}
    assert greedy_vs_plain(records, plain) == {
        "turns": 3,
        "identical": 1,
        "first_turns": 2,
        "first_turns_identical": 1,
        "first_difference_median": 3,  # 1/1 is one token longer (at 3), 2/0 differs at 2
    }
