"""`eyas evaluate` with the built-in engine: prompts, rejection sampling, greedy identity, reports."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import evalkit
from eyas.errors import EyasError
from eyas.evaluate.prompts import Question, read_questions, render_turn
from eyas.evaluate.rejection import verify_greedy, verify_sampling
from eyas.evaluate.report import aggregate
from eyas.evaluate.speculative import DraftRunner, TargetRunner, plain_generate, speculative_generate


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from eyas.draft.model import Eagle3Draft
    from eyas.target import resolve_target

    tdir, draft_dir = evalkit.session_dirs(tmp_path_factory)
    target = resolve_target(tdir)
    model = target.load_model(dtype=torch.float32)
    return target, model, Eagle3Draft.from_pretrained(draft_dir), draft_dir


# ----------------------------------------------------------------------------- prompts


def test_read_questions_reports_bad_lines(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question_id": 1, "category": "x", "turns": ["a"]}\n{"question_id": 2, "turns": []}\n')
    with pytest.raises(EyasError, match=r"q.jsonl:2: 'turns'"):
        read_questions(p)
    p.write_text('{"question_id": 1, "turns": ["a"]}\nnot json\n')
    with pytest.raises(EyasError, match=r"q.jsonl:2: not valid JSON"):
        read_questions(p)
    p.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n')
    with pytest.raises(EyasError, match="appears twice"):
        read_questions(p)


def test_default_mt_bench_is_in_the_repo():
    from eyas.evaluate.prompts import DEFAULT_PROMPTS

    qs = read_questions(DEFAULT_PROMPTS)
    assert len(qs) == 80 and all(len(q.turns) == 2 for q in qs)
    assert len({q.category for q in qs}) == 8
    assert (DEFAULT_PROMPTS.parent / "LICENSE").is_file()
    assert len(read_questions(DEFAULT_PROMPTS, max_prompts=5)) == 5
    per_cat = read_questions(DEFAULT_PROMPTS, max_per_category=2)
    assert len(per_cat) == 16 and all(sum(q.category == c.category for q in per_cat) == 2 for c in per_cat)


def test_categories_in_turn_spread_any_first_questions_over_every_category():
    """The serving-speed prompts: MT-bench's first 32 questions are 3 of its 8 categories; the first
    32 taken with categories in turn are 4 of each, and nothing is lost or repeated."""
    from eyas.evaluate.prompts import DEFAULT_PROMPTS, categories_in_turn

    qs = read_questions(DEFAULT_PROMPTS)
    spread = categories_in_turn(qs)
    assert sorted(q.question_id for q in spread) == sorted(q.question_id for q in qs)
    assert len({q.category for q in qs[:32]}) < 8
    first = spread[:32]
    assert all(sum(q.category == c for q in first) == 4 for c in {q.category for q in qs})
    uneven = [Question(str(i), c, ("t",)) for i, c in enumerate("aaabcc")]
    assert [q.question_id for q in categories_in_turn(uneven)] == ["0", "3", "4", "1", "5", "2"]


def test_the_second_prompt_set_humaneval_is_in_the_repo():
    """data/humaneval (scripts/make_humaneval_prompts.py): HumanEval's 164 stubs, one turn each."""
    from eyas.evaluate.prompts import DEFAULT_PROMPTS

    path = DEFAULT_PROMPTS.parents[1] / "humaneval" / "question.jsonl"
    qs = read_questions(path)
    assert len(qs) == 164 and all(len(q.turns) == 1 and "def " in q.turns[0] for q in qs)
    assert {q.category for q in qs} == {"coding"} and (path.parent / "LICENSE").is_file()


def test_second_turn_follows_the_models_first_answer(setup):
    target = setup[0]
    tok = target.load_tokenizer()
    q = Question("7", "writing", ("first question", "second question"))
    ids = render_turn(tok, q, 1, ["the model said this"])
    text = tok.decode(ids)
    assert text.index("first question") < text.index("the model said this") < text.index("second question")
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        render_turn(tok, q, 1, [])


# ----------------------------------------------------------------------------- verification


def test_verify_greedy_accepts_the_matching_prefix():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    best = logits.argmax(-1)
    drafts = best[:3].clone()
    assert verify_greedy(logits, drafts) == (3, int(best[3]))
    drafts[1] = (best[1] + 1) % 10
    assert verify_greedy(logits, drafts) == (1, int(best[1]))


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_rejection_sampling_reproduces_the_target_distribution():
    """Emitted tokens follow p, not q: first token ~ p0; given d1 accepted, the second ~ p1."""
    g = torch.Generator().manual_seed(0)
    V, k, N = 6, 3, 20000
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    first = torch.zeros(V)
    second = torch.zeros(V)
    accepted = 0
    for _ in range(N):
        d = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
        n, nxt = verify_sampling(p, q, d, g)
        emitted = d[:n].tolist() + [nxt]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
        accepted += n
    # Sampling noise of a 6-bin histogram at N=20000 is ~0.01 TV; p and q are far apart.
    assert _tv(first, p[0]) < 0.02
    assert _tv(second, p[1]) < 0.03
    assert 0.5 * float((p[0] - q[0]).abs().sum()) > 0.2  # the test could tell p from q
    assert 0 < accepted < N * k


def test_speculative_sampling_end_to_end_matches_target(setup):
    """Many samples of the first two tokens through the whole loop (untrained draft, so most drafts
    are rejected and resampled) against the target's exact joint distribution."""
    from eyas.draft.model import DraftConfig, Eagle3Draft

    target, model = setup[0], setup[1]
    cfg = DraftConfig.from_target(target.config(), evalkit.AUX, setup[2].config.draft_vocab_size, target.identity)
    draft = Eagle3Draft.from_target(cfg, target.path, setup[2].d2t, setup[2].t2d, seed=1)
    tr, dr = TargetRunner(model, evalkit.AUX), DraftRunner(draft)
    prompt = evalkit.chat_prompts(target.load_tokenizer(), ["the quick brown fox"])[0]
    temp = 1.0
    with torch.inference_mode():
        p0 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temp, -1)
        top = p0.topk(6).indices  # covers most of the mass; the rest is one bin
        rows = torch.tensor([prompt + [int(t)] for t in top])
        p1 = torch.softmax(model(rows).logits[:, -1] / temp, -1)
    g = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, int], int] = {}
    N, rejected = 600, 0
    for _ in range(N):
        res = speculative_generate(tr, dr, prompt, 2, set(), k=2, temperature=temp, generator=g)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        rejected += res.accepted_per_pos[0] == 0
    # Exact joint over (top-6 first token) x (top-4 second token), everything else pooled.
    keys, exact = [], []
    for i, a in enumerate(top.tolist()):
        for b in p1[i].topk(4).indices.tolist():
            keys.append((a, b))
            exact.append(float(p0[a] * p1[i, b]))
    exact.append(1 - sum(exact))
    obs = [counts.get(key, 0) for key in keys]
    obs.append(N - sum(obs))
    tv = _tv(torch.tensor(obs, dtype=torch.float), torch.tensor(exact))
    assert tv < 0.08, (tv, obs, [round(e * N) for e in exact])
    # The untrained draft is mostly rejected: the second token usually comes from the residual.
    assert rejected > N // 2
    tr.close()


# ----------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_output_equals_plain_greedy(setup, k):
    target, model, draft = setup[0], setup[1], setup[2]
    tr, dr = TargetRunner(model, draft.config.aux_layer_ids), DraftRunner(draft)
    prompts = evalkit.chat_prompts(target.load_tokenizer(), evalkit.PROMPTS)
    total_rounds = total_acc = 0
    for prompt in prompts:
        plain = plain_generate(tr, prompt, 40, set())
        spec = speculative_generate(tr, dr, prompt, 40, set(), k=k)
        assert spec.tokens == plain.tokens
        # every round emits its accepted drafts + one target token; the tail is cut at max_new_tokens
        assert len(spec.tokens) == min(40, 1 + spec.rounds + spec.accepted)
        assert all(a >= b for a, b in zip(spec.accepted_per_pos, spec.accepted_per_pos[1:]))
        total_rounds += spec.rounds
        total_acc += spec.accepted
    tr.close()
    assert total_acc > 0.3 * total_rounds, "the trained draft should be accepted regularly"


def test_greedy_identity_with_stop_tokens(setup):
    target, model, draft = setup[0], setup[1], setup[2]
    tr, dr = TargetRunner(model, draft.config.aux_layer_ids), DraftRunner(draft)
    prompt = evalkit.chat_prompts(target.load_tokenizer(), ["numbers dog fox"])[0]
    free = plain_generate(tr, prompt, 30, set()).tokens
    stop = {free[8]}  # stop on a token that appears mid-way
    plain = plain_generate(tr, prompt, 30, stop).tokens
    spec = speculative_generate(tr, dr, prompt, 30, stop, k=4).tokens
    tr.close()
    assert spec == plain and plain[-1] in stop and len(plain) <= 9


@pytest.mark.parametrize("k", [2, 4])
def test_steps_record_reads_a_run_without_stops_as_the_loop_with_them(setup, k, monkeypatch):
    """The vllm engine's reading (eyas.evaluate.speculative.steps_record): answers generated past
    the cut (max_new_tokens + k + 1, no stop tokens) and the tokens gained per step give exactly the
    record of the builtin loop run with the cut and the stop tokens: tokens, rounds, acceptance per
    position, the stop round counted whole."""
    from eyas.evaluate import speculative
    from eyas.evaluate.speculative import steps_record

    target, model, draft = setup[0], setup[1], setup[2]
    tr, dr = TargetRunner(model, draft.config.aux_layer_ids), DraftRunner(draft)
    prompts = evalkit.chat_prompts(target.load_tokenizer(), evalkit.PROMPTS)
    accepted: list[int] = []
    real = speculative.verify_greedy

    def spy(logits, drafts):  # the drafts accepted in each round of the uncut run
        n, nxt = real(logits, drafts)
        accepted.append(int(n))
        return n, nxt

    max_new, seen_stop = 20, 0
    for prompt in prompts:
        free = plain_generate(tr, prompt, max_new, set()).tokens
        for stop in (set(), {free[7]}):  # no stop, and a token met mid-answer
            want = speculative_generate(tr, dr, prompt, max_new, stop, k=k)
            accepted.clear()
            monkeypatch.setattr(speculative, "verify_greedy", spy)
            uncut = speculative_generate(tr, dr, prompt, max_new + k + 1, set(), k=k)
            monkeypatch.setattr(speculative, "verify_greedy", real)
            steps = [1] + [n + 1 for n in accepted]
            got = steps_record(uncut.tokens, steps, max_new, stop, k)
            assert got["tokens"] == want.tokens
            assert (got["rounds"], got["accepted_per_pos"]) == (want.rounds, want.accepted_per_pos)
            seen_stop += bool(stop) and len(want.tokens) < max_new
    tr.close()
    assert seen_stop, "a stop token cut some answer short"


def test_acceptance_read_from_steps_is_checked_against_vllms_own():
    from eyas.evaluate.vllm_metrics import agrees_with_vllm

    assert agrees_with_vllm([1, 3, 1, 2], [2, 0, 1])
    assert agrees_with_vllm([1, 3, 1, 2], [2, 0, 3])  # the last round cut by max_tokens
    assert not agrees_with_vllm([1, 3, 1, 2], [2, 1, 1])
    assert not agrees_with_vllm([1, 3, 1, 1, 2], [2, 0, 1])  # a step vLLM did not count as a round


# ----------------------------------------------------------------------------- report + CLI


def test_aggregate_pools_counts_like_vllm():
    recs = [
        {"category": "a", "rounds": 4, "accepted_per_pos": [3, 2, 1], "new_tokens": 11, "seconds": 1.0},
        {"category": "b", "rounds": 6, "accepted_per_pos": [2, 0, 0], "new_tokens": 9, "seconds": 1.0},
    ]
    o = aggregate(recs, 3)
    assert o["rounds"] == 10 and o["accepted_per_pos"] == [5, 2, 1]
    assert o["tau"] == pytest.approx(1 + 8 / 10)
    assert o["acceptance_rate_per_pos"] == pytest.approx([0.5, 0.2, 0.1])
    assert o["tokens_per_s"] == pytest.approx(10.0)


def test_evaluate_cli_builtin_report_and_resume(setup, tmp_path):
    from eyas.evaluate.cli import register

    target, draft_dir = setup[0], setup[3]
    # a draft with the tau `eyas train --tau` measured beside it (tau.json)
    draft_dir = Path(shutil.copytree(draft_dir, tmp_path / "draft"))
    trained = {
        "step": 9,
        "tau": {"3": 1.234, "5": 1.3},
        "turns": 8,
        "questions": 4,
        "prompts": "q.jsonl",
        "max_new_tokens": 24,
    }
    (draft_dir / "tau.json").write_text(json.dumps(trained))
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 4)
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # typer: keep sub-command names with two commands
    out = tmp_path / "eval"
    args = [
        "evaluate",
        "--target",
        str(target.path),
        "--draft",
        str(draft_dir),
        "--prompts",
        str(qfile),
        "--out",
        str(out),
        "-k",
        "3",
        "--max-new-tokens",
        "24",
        "--max-prompts",
        "3",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "builtin: tau" in res.output
    rep = json.loads((out / "builtin" / "report.json").read_text())
    # the report carries the tau training measured at this k, and says what it was measured on
    assert rep["training_tau"] == 1.234 and rep["training_tau_on"]["turns"] == 8
    assert "measured while training: 1.234, on 8 turns of q.jsonl, 24 tokens" in res.output
    assert (out / "builtin" / "acceptance_per_position.png").stat().st_size > 1000
    assert (out / "builtin" / "tau_per_category.png").stat().st_size > 1000
    pp = rep["per_prompt"]
    assert len(pp) == 6 and {r["turn"] for r in pp} == {0, 1}  # 3 questions x 2 turns
    assert set(rep["per_category"]) == {"writing", "math", "coding"}
    rounds = sum(r["rounds"] for r in pp)
    acc = sum(sum(r["accepted_per_pos"]) for r in pp)
    assert rep["overall"]["tau"] == pytest.approx(1 + acc / rounds)
    assert rep["overall"]["matches_plain"] == 6  # greedy: identical to plain decoding
    assert rep["overall"]["speedup"] > 0 and rep["overall"]["tokens_per_s"] > 0
    # turn 2 was rendered after the model's own turn-1 answer: its prompt is longer
    assert pp[1]["prompt_tokens"] > pp[0]["prompt_tokens"] + pp[0]["new_tokens"] - 2
    # resume: a second run reuses the stored records (nothing regenerated)
    before = (out / "builtin" / "records.jsonl").read_text()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (out / "builtin" / "records.jsonl").read_text() == before
    # a kill in the middle of a write: the torn question is redone, the file is whole again
    rec_file = out / "builtin" / "records.jsonl"
    rec_file.write_text(before.rstrip("\n").rsplit("\n", 1)[0] + "\n" + before.rstrip("\n").rsplit("\n", 1)[1][:25])
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    lines = rec_file.read_text().splitlines()
    assert [json.loads(x)["question_id"] for x in lines[1:]] == [
        json.loads(x)["question_id"] for x in before.splitlines()[1:]
    ]
    # other settings in the same --out are refused, not mixed
    res = CliRunner().invoke(app, args[:-4] + ["--max-new-tokens", "10"])
    assert res.exit_code != 0 and "other settings" in str(res.exception)
    res = CliRunner().invoke(app, args + ["--no-plain"])  # records without the plain baseline
    assert res.exit_code != 0 and "plain_baseline" in str(res.exception)


def test_also_k_evaluates_each_k_as_its_own_run_would(setup, tmp_path):
    """`eyas evaluate -k 3 --also-k 2`: k=2's report in OUT/k2/ is the one `-k 2` alone writes (same
    tokens, rounds and acceptance per turn), and a re-run resumes both."""
    from eyas.evaluate.cli import register

    target, draft_dir = setup[0], setup[3]
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 2)
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    base = [
        "evaluate",
        "--target",
        str(target.path),
        "--draft",
        str(draft_dir),
        "--prompts",
        str(qfile),
        "--max-new-tokens",
        "16",
        "--no-plain",
        "--quiet",
    ]
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "both"), "-k", "3", "--also-k", "2"])
    assert res.exit_code == 0, res.output
    assert "k=3 builtin: tau" in res.output and "k=2 builtin: tau" in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "alone"), "-k", "2"])
    assert res.exit_code == 0, res.output
    keep = ("question_id", "turn", "output_ids", "rounds", "accepted_per_pos")
    read = lambda p: [{f: r[f] for f in keep} for r in json.loads(p.read_text())["per_prompt"]]  # noqa: E731
    also = read(tmp_path / "both" / "k2" / "builtin" / "report.json")
    assert also == read(tmp_path / "alone" / "builtin" / "report.json") and len(also) == 4
    main = json.loads((tmp_path / "both" / "builtin" / "report.json").read_text())
    assert main["num_speculative_tokens"] == 3 and len(main["overall"]["accepted_per_pos"]) == 3
    before = (tmp_path / "both" / "k2" / "builtin" / "records.jsonl").read_text()
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "both"), "-k", "3", "--also-k", "2"])
    assert res.exit_code == 0 and (tmp_path / "both" / "k2" / "builtin" / "records.jsonl").read_text() == before


@pytest.mark.parametrize("device,message", [("gpu", "choose auto"), ("cuda:x", "choose auto"), ("CPU", "choose auto")])
def test_evaluate_bad_device_is_refused_before_any_model_loads(tmp_path, device, message):
    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    # neither the target nor the draft exists: a load would fail with another message
    with pytest.raises(EyasError, match=rf"--device {device!r}: {message}"):
        evaluate(
            EvaluateConfig(target="no-such-target", draft=tmp_path / "no-draft", out=tmp_path / "e", device=device)
        )
    with pytest.raises(EyasError, match="--dtype 'fp8'"):
        evaluate(EvaluateConfig(target="no-such-target", draft=tmp_path / "no-draft", out=tmp_path / "e", dtype="fp8"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_evaluate_cuda_without_a_gpu_is_refused_by_the_cli(tmp_path):
    from eyas.evaluate.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(
        app, ["evaluate", "--target", "no-such-target", "--draft", str(tmp_path), "--device", "cuda"]
    )
    assert res.exit_code != 0 and "CUDA is not available" in str(res.exception)


def test_evaluate_device_cpu_equals_the_default_on_the_cpu(setup, tmp_path):
    """--device cpu gives today's CPU evaluation: float32, the same tokens and acceptance as the
    default (auto, which is cpu here) and as the loop run directly."""
    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    target, model, draft, draft_dir = setup
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 2)
    kw = dict(prompts=qfile, k=3, max_new_tokens=16, progress=False)
    cpu = evaluate(EvaluateConfig(target=str(target.path), draft=draft_dir, out=tmp_path / "cpu", device="cpu", **kw))[
        "builtin"
    ]
    default = evaluate(EvaluateConfig(target=str(target.path), draft=draft_dir, out=tmp_path / "default", **kw))[
        "builtin"
    ]
    assert cpu["device"] == "cpu" and cpu["dtype"] == "float32"
    strip = [
        {k: r[k] for k in ("output_ids", "rounds", "accepted_per_pos", "matches_plain")} for r in cpu["per_prompt"]
    ]
    assert strip == [
        {k: r[k] for k in ("output_ids", "rounds", "accepted_per_pos", "matches_plain")} for r in default["per_prompt"]
    ]
    assert cpu["overall"]["tau"] == default["overall"]["tau"]
    header = json.loads((tmp_path / "cpu" / "builtin" / "records.jsonl").read_text().splitlines()[0])
    assert set(header["settings"]) == {
        "target_id",
        "draft",
        "draft_sha256",
        "k",
        "temperature",
        "max_new_tokens",
        "dtype",
        "seed",
        "prompts",
        "prompts_sha256",
        "device",
        "engine",
        "plain_baseline",
    }
    assert header["settings"]["dtype"] == "float32" and header["settings"]["device"] == "cpu"
    # the loop itself, on the float32 model of the fixture: the same tokens
    first = cpu["per_prompt"][0]
    tok = target.load_tokenizer()
    from eyas.data.chat import stop_token_ids
    from eyas.evaluate.prompts import read_questions

    q = read_questions(qfile, None, None)[0]
    prompt = render_turn(tok, q, 0, [])
    res = speculative_generate(
        TargetRunner(model, list(draft.config.aux_layer_ids)),
        DraftRunner(draft),
        prompt,
        16,
        set(stop_token_ids(tok, target.path)),
        3,
    )
    assert res.tokens == first["output_ids"] and res.accepted_per_pos == first["accepted_per_pos"]


def test_evaluate_without_target_uses_the_drafts_own_and_names_a_missing_one(setup, tmp_path):
    """No --target: the target the draft was trained for (its config.json's target_spec) is
    evaluated, with the records an explicit --target gives; a draft that records none is refused
    with the flag to pass."""
    import shutil

    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    target, model, draft, draft_dir = setup
    recorded = json.loads((draft_dir / "config.json").read_text())["target_spec"]
    assert recorded, "the test draft must record its target"
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 1)
    kw = dict(prompts=qfile, k=2, max_new_tokens=8, progress=False)
    own = evaluate(EvaluateConfig(draft=draft_dir, out=tmp_path / "own", **kw))["builtin"]
    given = evaluate(EvaluateConfig(target=str(target.path), draft=draft_dir, out=tmp_path / "given", **kw))["builtin"]
    assert own["target_name"] == recorded and own["target"] == given["target"]
    assert [r["output_ids"] for r in own["per_prompt"]] == [r["output_ids"] for r in given["per_prompt"]]

    bare = tmp_path / "bare-draft"
    shutil.copytree(draft_dir, bare)
    cfg = json.loads((bare / "config.json").read_text())
    cfg["target_spec"] = ""
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EyasError, match=r"records no target.*pass --target"):
        evaluate(EvaluateConfig(draft=bare, out=tmp_path / "bare", **kw))


def test_worker_processes_give_the_records_of_one_process(setup, tmp_path):
    """--workers 2: the questions are shared by two processes and come back in any order; the
    report is the one process's, record for record, and the records file of one run resumes the
    other (the worker count is not a setting of the results)."""
    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    target, _, _, draft_dir = setup
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 3)
    kw = dict(prompts=qfile, k=3, max_new_tokens=12, progress=False, compare_plain=False)
    one = evaluate(EvaluateConfig(target=str(target.path), draft=draft_dir, out=tmp_path / "one", **kw))["builtin"]
    two = evaluate(EvaluateConfig(target=str(target.path), draft=draft_dir, out=tmp_path / "two", workers=2, **kw))[
        "builtin"
    ]
    keys = ("question_id", "turn", "output_ids", "rounds", "accepted_per_pos")
    assert [{k: r[k] for k in keys} for r in two["per_prompt"]] == [{k: r[k] for k in keys} for r in one["per_prompt"]]
    assert len(two["per_prompt"]) == 6 and two["workers"] == 2 and two["overall"]["tau"] == one["overall"]["tau"]
    # the threads each worker ran with, not the parent's
    assert two["torch_threads"] == max(1, (os.cpu_count() or 1) // 2)
    # a run with one process over the two-worker records has nothing left to do
    again = evaluate(EvaluateConfig(target=str(target.path), draft=draft_dir, out=tmp_path / "two", **kw))["builtin"]
    assert again["per_prompt"] == two["per_prompt"]


def test_a_stopped_worker_pool_ends_its_workers_without_waiting_for_their_questions(setup):
    """A run stopped by SIGINT closes its pool with ``now``: a worker busy with a long question is
    ended at once (on the GPU, waiting for the questions in flight held a stopped run a minute past
    its budget, and the device call ran out before the run's results were copied)."""
    import time

    from eyas.evaluate.workers import BuiltinPool
    from eyas.vllm.worker.protocol import alive

    target, _, _, draft_dir = setup
    pool = BuiltinPool(2, target, draft_dir, 3, 0.0, 0, False, "float32", "cpu", 8, set())
    busy = [pool.exe.submit(time.sleep, 300) for _ in range(2)]  # stand-ins for long questions
    deadline = time.time() + 120
    while not all(f.running() for f in busy) and time.time() < deadline:
        time.sleep(0.1)
    procs = list(pool.exe._processes.values())
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    start = time.perf_counter()
    pool.close(now=True)
    assert time.perf_counter() - start < 30
    # by the kernel's word: the executor's own thread may reap a worker before Process.is_alive() polls
    # it, which then reads as alive for ever
    assert not any(alive(p.pid) for p in procs)


def test_vllm_draft_must_be_an_export_of_the_draft(setup, tmp_path):
    """An exported directory handed to the vllm engine (the pipeline's export stage) is checked
    against the draft before vLLM is looked for; another draft's export is refused."""
    from safetensors.torch import load_file, save_file

    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import check_export_of, evaluate
    from eyas.export.config import ExportConfig
    from eyas.export.run import run as run_export

    target, draft_dir = setup[0], setup[3]
    exported = run_export(ExportConfig(ckpt=draft_dir, format="vllm", out=tmp_path / "exp", target=None))
    check_export_of(exported, draft_dir)  # its own export passes
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((draft_dir / "config.json").read_text())
    state = load_file(str(draft_dir / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"] * 1.5
    save_file(state, str(other / "model.safetensors"))
    with pytest.raises(EyasError, match="exported from another draft"):
        check_export_of(exported, other)
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 1)
    with pytest.raises(EyasError, match="exported from another draft"):
        evaluate(
            EvaluateConfig(
                target=str(target.path),
                draft=other,
                prompts=qfile,
                out=tmp_path / "e",
                engine="vllm",
                vllm_draft=exported,
                progress=False,
            )
        )


def test_stop_at_stops_between_ks_and_a_rerun_goes_on(setup, tmp_path, monkeypatch):
    """EYAS_STOP_AT (a job scheduler's end): no further k starts once it leaves too little time; the
    k done is kept, a run without it goes on from there, and a finished k is only read back."""
    import time

    from eyas.evaluate.cli import register

    target, draft_dir = setup[0], setup[3]
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 2)
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    out = tmp_path / "eval"
    args = ["evaluate", "--target", str(target.path), "--draft", str(draft_dir), "--prompts", str(qfile)]
    args += ["--max-new-tokens", "12", "--no-plain", "--quiet", "--out", str(out), "-k", "3", "--also-k", "2"]
    monkeypatch.setenv("EYAS_STOP_AT", str(time.time() - 1))
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "stopped before k=2" in str(res.exception), res.output
    assert (out / "builtin" / "report.json").is_file() and not (out / "k2").exists()
    monkeypatch.delenv("EYAS_STOP_AT")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    turns = lambda: json.loads((out / "k2" / "builtin" / "report.json").read_text())["per_prompt"]  # noqa: E731
    k2 = turns()
    monkeypatch.setenv("EYAS_STOP_AT", str(time.time() - 1))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert turns() == k2


def test_stop_at_that_is_no_time_is_named(monkeypatch):
    from eyas import deadline
    from eyas.errors import EyasError

    monkeypatch.setenv("EYAS_STOP_AT", "tomorrow")
    with pytest.raises(EyasError, match="EYAS_STOP_AT='tomorrow'"):
        deadline.check(0, "k=2")
