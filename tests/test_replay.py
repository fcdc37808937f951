"""`eyas evaluate --engine replay`: greedy acceptance for every k from one pass over the target's own
answers, checked against the builtin speculative loop it stands for."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import evalkit
from eyas.cli import app
from eyas.evaluate.replay import ReplayScorer, chain_lengths, greedy_answers, replay_record, walk
from eyas.evaluate.speculative import DraftRunner, TargetRunner, plain_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from eyas.draft.model import Eagle3Draft
    from eyas.target import resolve_target

    tdir, draft_dir = evalkit.session_dirs(tmp_path_factory)
    target = resolve_target(tdir)
    return target, target.load_model(dtype=torch.float32), Eagle3Draft.from_pretrained(draft_dir), draft_dir


def test_chain_lengths_count_the_leading_right_steps_only():
    correct = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    assert chain_lengths(correct).tolist() == [2, 1, 0, 3]


def test_walk_gains_one_plus_the_capped_chain_per_round():
    # after e tokens the chain lengths[e-1] is accepted, at most k of it
    assert walk([5, 0, 0, 0, 0, 0, 0, 0], 2, 8) == [1, 3, 1, 1, 1, 1]
    assert walk([0, 3, 0, 0, 0, 0], 3, 6) == [1, 1, 4]


@pytest.mark.parametrize("stop_at", [None, 8])
def test_replay_gives_the_builtin_loops_record_for_every_k(setup, stop_at):
    """For k = 1..5 (the draft was trained with 3 TTT steps) and with a stop token met mid-answer or
    none: the answers decoded in a batch are the loop's one at a time, and the record replayed from
    one 5-step unroll is the loop's, round for round and position for position."""
    target, model, draft, _ = setup
    prompts = evalkit.chat_prompts(target.load_tokenizer(), evalkit.PROMPTS)
    tr, dr = TargetRunner(model, draft.config.aux_layer_ids), DraftRunner(draft)
    max_new, top = 30, 5
    stop = set() if stop_at is None else {plain_generate(tr, prompts[2], 30, set()).tokens[stop_at]}
    uncut = greedy_answers(model, prompts, max_new + top + 1, batch_size=3)
    scorer = ReplayScorer(model, draft)
    accepted = stopped = 0
    for prompt, answer in zip(prompts, uncut):
        assert answer == plain_generate(tr, prompt, max_new + top + 1, set()).tokens
        lengths = scorer.lengths(prompt, answer, top)
        for k in range(1, top + 1):
            want = speculative_generate(tr, dr, prompt, max_new, stop, k=k)
            ref = {
                "question_id": "q",
                "category": "c",
                "turn": 0,
                "prompt_tokens": len(prompt),
                "uncut_ids": answer,
                "output_ids": want.tokens,
            }
            got = replay_record(ref, lengths, k, max_new, stop)
            assert (got["rounds"], got["accepted_per_pos"]) == (want.rounds, want.accepted_per_pos), k
            accepted += want.accepted
        stopped += len(want.tokens) < max_new
    scorer.close()
    tr.close()
    assert accepted > 0, "the trained draft is accepted somewhere"
    assert stopped or stop_at is None, "the stop token cut some answer short"


def _invoke(setup, questions, out, *args):
    """`eyas evaluate` of the session's draft on ``questions`` into ``out``: its CliRunner result."""
    target, _, _, draft_dir = setup
    return CliRunner().invoke(
        app,
        [
            "evaluate",
            "--target",
            str(target.path),
            "--draft",
            str(draft_dir),
            "--prompts",
            str(questions),
            "--out",
            str(out),
            "--max-new-tokens",
            "24",
            "--quiet",
            *args,
        ],
    )


def _evaluate(setup, questions, out, *args):
    res = _invoke(setup, questions, out, *args)
    assert res.exit_code == 0, res.output
    return res.output


def test_replay_cli_reports_every_k_as_the_builtin_engine_does(setup, tmp_path):
    """`--engine replay -k 3 --also-k 1,5` writes the same reports' acceptance as `--engine builtin` with
    the same k's (MT-bench style questions, two turns each, the second after the model's own answer),
    keeps the target's answers, and a second draft's run reuses them without decoding again."""
    questions = evalkit.write_questions(tmp_path / "q.jsonl", 5)
    _evaluate(setup, questions, tmp_path / "b", "--engine", "builtin", "-k", "3", "--also-k", "1,5")
    out = _evaluate(setup, questions, tmp_path / "r", "--engine", "replay", "-k", "3", "--also-k", "1,5")
    assert "k=3 replay: tau" in out and "k=5 replay: tau" in out
    for sub in ("", "k1/", "k5/"):
        b = json.loads((tmp_path / f"b/{sub}builtin/report.json").read_text())
        r = json.loads((tmp_path / f"r/{sub}replay/report.json").read_text())
        assert r["engine"] == "replay" and r["num_speculative_tokens"] == b["num_speculative_tokens"]
        assert r["overall"]["tau"] == b["overall"]["tau"]
        assert r["overall"]["accepted_per_pos"] == b["overall"]["accepted_per_pos"]
        assert [(p["output_ids"], p["rounds"]) for p in r["per_prompt"]] == [
            (p["output_ids"], p["rounds"]) for p in b["per_prompt"]
        ]
        assert "speedup" not in r["overall"]
    assert r["overall"]["accepted_tokens"] > 0

    refs = tmp_path / "r" / "replay" / "references.jsonl"
    lines = refs.read_text().splitlines()
    assert len(lines) == 1 + 10 and json.loads(lines[0])["settings"]["tail"] == 8
    stamp = refs.stat().st_mtime_ns
    _evaluate(setup, questions, tmp_path / "r2", "--engine", "replay", "-k", "2", "--references", str(refs))
    assert refs.stat().st_mtime_ns == stamp  # every answer was there: nothing decoded, nothing written
    assert not (tmp_path / "r2" / "replay" / "references.jsonl").exists()
    r2 = json.loads((tmp_path / "r2" / "replay" / "report.json").read_text())
    assert r2["references"] == str(refs) and r2["num_speculative_tokens"] == 2


def test_references_serve_the_same_prompts_at_any_path_and_refuse_others(setup, tmp_path):
    """The target's answers are keyed by the prompts' content: the same questions copied elsewhere
    (another checkout, another machine's run) reuse a references file without decoding; one written
    before (the prompts' absolute path beside their sha256) is adopted with its answers; other
    questions are refused by name."""
    for d in "abc":
        (tmp_path / d).mkdir()
    questions = evalkit.write_questions(tmp_path / "a" / "q.jsonl", 3)
    _evaluate(setup, questions, tmp_path / "r", "--engine", "replay", "-k", "2")
    refs = tmp_path / "r" / "replay" / "references.jsonl"
    header, *answers = refs.read_text().splitlines()
    settings = json.loads(header)["settings"]
    assert settings["prompts"].startswith("sha256:") and str(tmp_path) not in header

    moved = tmp_path / "b" / "q.jsonl"
    moved.write_bytes(questions.read_bytes())
    stamp = refs.stat().st_mtime_ns
    _evaluate(setup, moved, tmp_path / "r2", "--engine", "replay", "-k", "2", "--references", str(refs))
    assert refs.stat().st_mtime_ns == stamp  # nothing decoded, nothing written

    old = {k: v for k, v in settings.items() if k != "prompts"}
    old |= {"prompts": str(questions.resolve()), "prompts_sha256": settings["prompts"].removeprefix("sha256:")}
    refs.write_text("\n".join([json.dumps({"settings": old}), *answers]) + "\n")
    _evaluate(setup, moved, tmp_path / "r3", "--engine", "replay", "-k", "2", "--references", str(refs))
    header3, *answers3 = refs.read_text().splitlines()
    assert json.loads(header3)["settings"] == settings and answers3 == answers

    other = evalkit.write_questions(tmp_path / "c" / "q.jsonl", 2)
    res = _invoke(setup, other, tmp_path / "r4", "--engine", "replay", "-k", "2", "--references", str(refs))
    msg = str(res.exception)
    assert res.exit_code != 0 and str(refs) in msg and "(prompts differ)" in msg


def test_evaluations_of_the_same_prompts_share_the_targets_answers_through_the_cache(setup, tmp_path, monkeypatch):
    """An evaluation's answers go to eyas's cache (where tau while training keeps its own); another
    evaluation of the same prompts in another OUT starts from the cache's answers and decodes only
    what the cache lacks, and gives the cache what it then has more of. A pipeline's training and
    evaluation of MT-bench so decode its answers once."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    questions = evalkit.write_questions(tmp_path / "q.jsonl", 4)
    _evaluate(setup, questions, tmp_path / "r", "--engine", "replay", "-k", "2")
    [cached] = (tmp_path / "cache" / "replay").glob("*.jsonl")
    header, *answers = cached.read_text().splitlines()
    assert len(answers) == 8 and cached.read_text() == (tmp_path / "r/replay/references.jsonl").read_text()

    # the cache keeps two questions' answers, marked: decoded again, they would come without the mark
    kept = [json.dumps({**json.loads(a), "from_cache": True}) for a in answers[:4]]
    cached.write_text("\n".join([header, *kept]) + "\n")
    _evaluate(setup, questions, tmp_path / "r2", "--engine", "replay", "-k", "3")
    _, *got = (tmp_path / "r2/replay/references.jsonl").read_text().splitlines()
    assert got[:4] == kept and all("from_cache" not in json.loads(a) for a in got[4:])
    assert [json.loads(a)["uncut_ids"] for a in got] == [json.loads(a)["uncut_ids"] for a in answers]
    assert cached.read_text().splitlines() == [header, *got]  # the cache now has all four


def test_replay_goes_on_from_the_chains_it_kept(setup, tmp_path):
    """The draft's chain lengths are kept question by question: a run stopped mid-way (its file cut
    after two questions, the last line torn) makes only the rest and reports what an unbroken run
    does; a run again with the same draft makes none and leaves the file as it was; another draft
    in the same OUT starts the file over and reports what it reports in a fresh OUT."""
    import shutil

    from safetensors.torch import load_file, save_file

    questions = evalkit.write_questions(tmp_path / "q.jsonl", 5)
    args = ("--engine", "replay", "-k", "3", "--also-k", "1")
    _evaluate(setup, questions, tmp_path / "r", *args)
    chains = tmp_path / "r" / "replay" / "chains.jsonl"
    whole = chains.read_text().splitlines()
    assert len(whole) == 1 + 10 and all(len(json.loads(x)["lengths"]) > 0 for x in whole[1:])

    def report(out):
        rep = json.loads((out / "replay" / "report.json").read_text())
        return [(p["question_id"], p["turn"], p["rounds"], p["accepted_per_pos"]) for p in rep["per_prompt"]]

    want = report(tmp_path / "r")
    chains.write_text("\n".join(whole[:5]) + "\n" + whole[5][:20])
    _evaluate(setup, questions, tmp_path / "r", *args)
    assert chains.read_text().splitlines() == whole  # the two kept questions as they were, the rest made again
    assert report(tmp_path / "r") == want

    stamp = chains.stat().st_mtime_ns
    _evaluate(setup, questions, tmp_path / "r", *args)
    assert chains.stat().st_mtime_ns == stamp and report(tmp_path / "r") == want

    _, _, _, draft_dir = setup
    other = tmp_path / "other-draft"
    shutil.copytree(draft_dir, other)
    weights = load_file(other / "model.safetensors")
    gen = torch.Generator().manual_seed(0)  # another draft: its layer moved by noise of its own size
    weights = {
        n: t + t.std() * torch.randn(t.shape, generator=gen) if n.startswith("midlayer") and t.dim() == 2 else t
        for n, t in weights.items()
    }
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    _evaluate(setup, questions, tmp_path / "r", *args, "--draft", str(other))
    _evaluate(setup, questions, tmp_path / "fresh", *args, "--draft", str(other))
    lines = chains.read_text().splitlines()
    fresh = (tmp_path / "fresh" / "replay" / "chains.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 10 and lines[0] == fresh[0] != whole[0]  # started over, for the other draft
    assert report(tmp_path / "r") == report(tmp_path / "fresh") != want


def test_tau_measured_while_training_is_what_evaluate_replay_gives(setup, tmp_path, monkeypatch):
    """`eyas train --tau`: at every --tau-every mark and at the end, the draft is replayed on the
    prompts; the last figure (in the draft's tau.json, summary.json and metrics.jsonl) equals `eyas
    evaluate --engine replay` on the final draft at each k (float32: exact), the target's answers
    are kept in eyas's cache, and a second run decodes nothing."""
    from eyas.train.trainer import TrainConfig, run as train

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    target, _, _, draft_dir = setup
    questions = evalkit.write_questions(tmp_path / "q.jsonl", 4)
    kw = dict(
        target=str(target.path),
        data=str(draft_dir.parents[1] / "data"),
        features="online",
        layers=evalkit.AUX,
        ttt_steps=3,
        tokens_per_batch=512,
        max_steps=30,
        warmup=5,
        lr=3e-3,
        save_every=0,
        eval_every=0,
        eval_batches=1,
        heldout=0.05,
        progress=False,
        tau=True,
        tau_prompts=questions,
        tau_per_category=0,
        tau_max_new_tokens=24,
        tau_k=[3, 5, 7],
        tau_every="1s",
    )
    run = tmp_path / "run"
    draft = train(TrainConfig(out=str(run), **kw))
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    tau = [r for r in recs if r["split"] == "tau"]
    assert tau[-1]["step"] == 30 and tau[-1]["turns"] == 8
    assert [r["train_s"] for r in tau] == sorted(r["train_s"] for r in tau)
    measured = json.loads((draft / "tau.json").read_text())
    assert measured["tau"] == tau[-1]["tau"] == json.loads((run / "summary.json").read_text())["tau"]["tau"]
    assert (run / "tau.png").is_file()
    _evaluate(
        (target, None, None, draft),
        questions,
        tmp_path / "e",
        "--engine",
        "replay",
        "-k",
        "3",
        "--also-k",
        "5,7",
        "--max-new-tokens",
        "24",
    )
    for k, sub in ((3, ""), (5, "k5/"), (7, "k7/")):
        rep = json.loads((tmp_path / f"e/{sub}replay/report.json").read_text())
        assert measured["tau"][str(k)] == pytest.approx(rep["overall"]["tau"], abs=1e-12), k
    assert max(measured["tau"].values()) > 1.0  # the draft accepts something: the comparison means something
    [refs] = (tmp_path / "cache" / "replay").glob("*.jsonl")
    stamp = refs.stat().st_mtime_ns
    train(TrainConfig(out=str(tmp_path / "run2"), **{**kw, "max_steps": 2, "tau_every": None}))
    assert refs.stat().st_mtime_ns == stamp
