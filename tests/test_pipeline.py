"""`eyas pipeline` end to end on a tiny target: every stage runs, a re-run resumes/skips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyas.config import load_config
from eyas.pipeline import run_pipeline


def _write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "convs.jsonl"
    rows = [
        {
            "prompt": f"Tell me about the number {i} and the quick brown fox.",
            "response": f"The number {i} is a number. The quick brown fox jumps over the lazy dog.",
        }
        for i in range(24)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = tmp_path / "question.jsonl"
    qs = [
        {"question_id": 1, "category": "writing", "turns": ["Hello! How can I help?", "Why is the sky blue?"]},
        {"question_id": 2, "category": "math", "turns": ["What is 1 + 2?"]},
    ]
    prompts.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    return data, prompts


def _config(tmp_path: Path, target: Path, features: str) -> Path:
    data, prompts = _write_inputs(tmp_path)
    cfg = {
        "target": str(target),
        "workdir": str(tmp_path / "run"),
        "features": features,
        "prepare": {"data": str(data), "max_length": 64, "draft_vocab_size": 128, "workers": 1},
        "extract": {"device": "cpu"},
        "train": {
            "ttt_steps": 2,
            "max_steps": 3,
            "tokens_per_batch": 128,
            "warmup": 1,
            "save_every": 2,
            "eval_every": 0,
            "device": "cpu",
        },
        "export": {"format": "vllm"},
        "evaluate": {"engine": "builtin", "prompts": str(prompts), "k": 2, "max_new_tokens": 6},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("features", ["online", "offline"])
def test_pipeline_runs_every_stage_and_resumes(tmp_path, tiny_llama_dir, features):
    cfg_path = _config(tmp_path, tiny_llama_dir, features)
    reports = run_pipeline(load_config(cfg_path))
    run = tmp_path / "run"
    assert (run / "prepared" / "manifest.json").is_file()
    assert (run / "store").is_dir() == (features == "offline")
    draft = run / "train" / "draft" / "model.safetensors"
    assert draft.is_file()
    exported = json.loads((run / "export-vllm" / "config.json").read_text())
    assert exported["speculators_model_type"] == "eagle3"
    report = json.loads((run / "eval" / "builtin" / "report.json").read_text())
    assert report["overall"]["prompts"] == 3  # two turns + one turn
    assert report["overall"]["tau"] >= 1.0
    assert reports["builtin"]["overall"]["tau"] == report["overall"]["tau"]

    # A second run finds every stage complete: the draft is not retrained.
    stamp = draft.stat().st_mtime_ns
    run_pipeline(load_config(cfg_path))
    assert draft.stat().st_mtime_ns == stamp


def test_pipeline_cli_refuses_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: x\ntrain:\n  ttt_step: 3\n")
    res = subprocess.run([sys.executable, "-m", "eyas.cli", "pipeline", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2
    assert "ttt_step" in res.stderr


def test_pipeline_passes_the_device_and_the_export_to_evaluate(tmp_path, tiny_llama_dir):
    """No device in the evaluate section: the train section's (cpu here) reaches evaluate and is
    recorded; the same device written into the evaluate section is the same setting (nothing redone).
    The export stage's output is an export of the trained draft, as the vllm engine checks. The tau
    measured while training takes evaluate's answer length, so it is the tau evaluate then measures."""
    from eyas.evaluate.run import check_export_of

    cfg_path = _config(tmp_path, tiny_llama_dir, "online")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["train"].update(tau=True, tau_prompts=cfg["evaluate"]["prompts"], tau_k=[2])
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert cfg["train"]["device"] == "cpu" and "device" not in cfg["evaluate"]
    run_pipeline(load_config(cfg_path))
    run = tmp_path / "run"
    rec = json.loads((run / "pipeline-config.json").read_text())
    assert rec["stages"]["evaluate"]["settings"]["device"] == "cpu"
    assert rec["sections"]["evaluate"]["device"] == "cpu"
    # training measures the evaluation it feeds: evaluate's max_new_tokens, a derived setting kept
    # out of train's record (a changed evaluate section must not make the draft stale)
    measured = json.loads((run / "train" / "draft" / "tau.json").read_text())
    assert "tau_max_new_tokens" not in cfg["train"] and measured["max_new_tokens"] == 6
    assert "tau_max_new_tokens" not in rec["stages"]["train"]["settings"]
    report = json.loads((run / "eval" / "builtin" / "report.json").read_text())
    assert measured["turns"] == report["overall"]["prompts"] == 3
    assert measured["tau"]["2"] == pytest.approx(report["overall"]["tau"], rel=1e-6)
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    check_export_of(run / "export-vllm", run / "train" / "draft")

    records = (run / "eval" / "builtin" / "records.jsonl").read_text()
    cfg["evaluate"]["device"] = "cpu"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_pipeline(load_config(cfg_path))
    assert (
        json.loads((run / "pipeline-config.json").read_text())["stages"]["evaluate"]["fingerprint"]
        == rec["stages"]["evaluate"]["fingerprint"]
    )
    assert (run / "eval" / "builtin" / "records.jsonl").read_text() == records
    assert not list(run.glob("eval.stale-*"))

    cfg["evaluate"]["device"] = "gpu"
    cfg_path.write_text(yaml.safe_dump(cfg))
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="evaluate.device 'gpu': choose auto"):
        load_config(cfg_path)  # before any stage runs


def test_a_seeded_answer_cache_is_not_taken_for_an_unrecorded_stage(tmp_path, tiny_llama_dir):
    """A new workdir whose prepared/ holds only a regeneration's answers (seeded from an earlier
    run, as the GPU job does) starts; anything else there that the pipeline did not record is refused."""
    from eyas.data.regenerate import CACHE, HEADER
    from eyas.errors import EyasError
    from eyas.pipeline import check_stale, stage_records

    cfg = load_config(_config(tmp_path, tiny_llama_dir, "online"))
    prepared = tmp_path / "run" / "prepared"
    prepared.mkdir(parents=True)
    (prepared / CACHE).write_text("")
    (prepared / HEADER).write_text("{}")
    check_stale(cfg, stage_records(cfg))
    (prepared / "manifest.json").write_text("{}")
    with pytest.raises(EyasError, match="no record of the settings"):
        check_stale(cfg, stage_records(cfg))


def test_a_job_done_in_stopped_runs_reports_its_time_per_stage(tmp_path, tiny_llama_dir, monkeypatch):
    """A run stopped in evaluate (as a timeout's SIGINT stops it) keeps the seconds of the stages
    it ran, that one included; the run that finishes adds its own, and a skipped train keeps its time."""
    import eyas.evaluate.run

    cfg_path = _config(tmp_path, tiny_llama_dir, "online")
    evaluate = eyas.evaluate.run.run

    def stopped(*args, **kwargs):
        evaluate(*args, **kwargs)  # the evaluation's work is done, then the stop comes
        raise KeyboardInterrupt

    monkeypatch.setattr(eyas.evaluate.run, "run", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(load_config(cfg_path))
    timings_path = tmp_path / "run" / "pipeline-timings.json"
    first = json.loads(timings_path.read_text())
    assert set(first["seconds"]) == {"prepare", "train", "export", "evaluate"}
    assert first["seconds"]["train"] > 0 and first["seconds"]["evaluate"] > 0
    assert "evaluate" not in first["done"] and "train" in first["done"]

    monkeypatch.setattr(eyas.evaluate.run, "run", evaluate)
    run_pipeline(load_config(cfg_path))
    second = json.loads(timings_path.read_text())
    assert second["seconds"]["train"] == first["seconds"]["train"]  # skipped: not retrained
    assert second["runs"] == {"prepare": 2, "train": 1, "export": 2, "evaluate": 2}
    assert second["seconds"]["evaluate"] > first["seconds"]["evaluate"]
    assert set(second["done"]) == {"prepare", "train", "export", "evaluate"}


def test_the_pipeline_puts_the_measured_serving_speed_into_the_exports_card(tmp_path, tiny_llama_dir, monkeypatch):
    """The export stage writes the model card (README.md) without a serving speed; once evaluate has
    timed vLLM serving (vLLM stood in for by tests/fake_vllm.py), the pipeline writes the card again,
    into the export's folder, with the speedups and the best k in its `vllm serve` line. The card
    names the data the prepare stage made and the tau measured while training."""
    import shlex

    import fake_vllm
    import eyas.evaluate.run

    cfg_path = _config(tmp_path, tiny_llama_dir, "online")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["train"].update(tau=True, tau_prompts=cfg["evaluate"]["prompts"], tau_k=[1, 2])
    cfg["evaluate"].update(engine="vllm", also_k=[1], speed_concurrency=[1], speed_min_seconds=0)
    cfg_path.write_text(yaml.safe_dump(cfg))
    fake_vllm.use(monkeypatch, {(None, 1): 100.0, (1, 1): 130.0, (2, 1): 120.0})
    run = tmp_path / "run"
    card_path = run / "export-vllm" / "README.md"
    before = []
    evaluate = eyas.evaluate.run.run

    def spied(*args, **kwargs):
        before.append(card_path.read_text())  # what the export stage wrote
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(eyas.evaluate.run, "run", spied)
    run_pipeline(load_config(cfg_path))
    assert "## Serving speed (vLLM, output tokens/s)\n\nNot measured" in before[0]
    assert "k = 3: the export's num_speculative_tokens" in before[0]  # export's default
    card = card_path.read_text()
    manifest = json.loads((run / "prepared" / "manifest.json").read_text())
    assert f"(id `{manifest['id']}`): {manifest['counts']['samples']} conversations" in card
    assert "- source `convs`" in card and "24 records" in card
    assert "While training: greedy, at step 3, on 3 turns" in card
    assert "| 1 | 1 | 130 | 100 | 1.30x |" in card and "| 1 | 2 | 120 | 100 | 1.20x |" in card
    assert "- 1 concurrent: best k = 1, 1.30x" in card
    line = next(x for x in card.splitlines() if x.startswith("vllm serve "))
    config = json.loads(shlex.split(line)[4])
    assert config == {"method": "eagle3", "model": str((run / "export-vllm").resolve()), "num_speculative_tokens": 1}
    assert not list((run / "eval").rglob("README.md"))  # evaluate wrote no card in its own folder
    assert json.loads((run / "eval" / "vllm" / "report.json").read_text())["best_k"]["1"]["k"] == 1


def test_the_exports_card_gains_the_tau_a_replay_evaluation_measured(tmp_path, tiny_llama_dir):
    """Without a serving speed (evaluate by replay, the GPU configs' cheap engine) the pipeline still
    writes the card again with the tau per k its evaluation measured, naming the engine."""
    cfg_path = _config(tmp_path, tiny_llama_dir, "online")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["evaluate"].update(engine="replay", also_k=[1])
    cfg_path.write_text(yaml.safe_dump(cfg))
    reports = run_pipeline(load_config(cfg_path))
    card = (tmp_path / "run" / "export-vllm" / "README.md").read_text()
    tau = {2: reports["replay"]["overall"]["tau"], 1: reports["k1"]["replay"]["overall"]["tau"]}
    assert "| k | tau while training | tau in evaluate (replay) |" in card
    for k, t in tau.items():
        assert f"| {k} | not measured | {t:,.2f} |" in card
    assert "In evaluate: replay, on " in card and "temperature 0.0, 6 new tokens" in card


def test_the_train_stage_leaves_no_model_alive_for_the_stages_after_it(tmp_path, tiny_llama_dir, monkeypatch):
    # evaluate's vLLM engine runs in its own process: the GPU memory of the target and draft that
    # online training loaded can only go back to it (release_device_memory) if nothing holds them
    import gc

    import torch

    import eyas.export.run as export_run

    def live_modules() -> int:
        gc.collect()
        return sum(isinstance(o, torch.nn.Module) for o in gc.get_objects())

    seen: dict[str, int] = {}
    real = export_run.run

    def export_counting_first(cfg):
        seen["at export"] = live_modules()
        return real(cfg)

    monkeypatch.setattr(export_run, "run", export_counting_first)
    before = live_modules()
    run_pipeline(load_config(_config(tmp_path, tiny_llama_dir, "online")))
    assert seen["at export"] == before
