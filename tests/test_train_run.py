"""`eyas train` end to end on a tiny target: online/offline, checks, SIGKILL + resume, torchrun DDP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tiny
from eyas.errors import EyasError
from eyas.train.checkpoint import checkpoint_dirs
from eyas.train.trainer import TrainConfig, run as train

PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory) -> Path:
    return tiny.random_prepared(tmp_path_factory.mktemp("prep") / "data", tiny_target)


def _cfg(tiny_target, data, out, **kw) -> TrainConfig:
    base = dict(
        target=str(tiny_target.path),
        data=str(data),
        out=str(out),
        features="online",
        layers=[1, 4, 6],
        ttt_steps=3,
        tokens_per_batch=128,
        max_steps=4,
        warmup=1,
        lr=1e-3,
        save_every=2,
        eval_every=2,
        eval_batches=2,
        heldout=0.1,
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _records(run: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def _cli(*args: str) -> list[str]:
    return [PY, "-m", "eyas.cli", "train", *args]


def test_online_run_writes_draft_logs_plot(tiny_target, data, tmp_path):
    from typer.testing import CliRunner

    from eyas.cli import app
    from eyas.draft.model import Eagle3Draft

    run = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--target",
            str(tiny_target.path),
            "--data",
            str(data),
            "--out",
            str(run),
            "--online",
            "--layers",
            "1,4,6",
            "--ttt-steps",
            "3",
            "--tokens-per-batch",
            "128",
            "--max-steps",
            "6",
            "--warmup",
            "1",
            "--lr",
            "3e-3",
            "--save-every",
            "3",
            "--eval-every",
            "3",
            "--eval-batches",
            "2",
            "--heldout",
            "0.1",
        ],
    )
    assert res.exit_code == 0, res.output
    draft = Eagle3Draft.from_pretrained(run / "draft")
    assert draft.config.aux_layer_ids == [1, 4, 6] and draft.config.target["id"] == tiny_target.id
    # where the target is, for `eyas export` without --target
    assert draft.config.target_name_or_path == str(tiny_target.path)
    assert draft.config.target_token_ids == {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3}
    train_recs = _records(run)
    assert [r["step"] for r in train_recs] == list(range(1, 7))
    assert all(len(r["acc"]) == 3 and r["tokens_per_s"] > 0 for r in train_recs)
    elapsed = [r["elapsed_s"] for r in train_recs]  # wall seconds of the run at each record, rising
    assert elapsed[0] > 0 and all(a <= b for a, b in zip(elapsed, elapsed[1:]))
    stamps = [r["time"] for r in train_recs]  # the wall clock, as other logs give it
    assert 0 <= time.time() - stamps[-1] < 600 and stamps == sorted(stamps)
    held = _records(run, "heldout")
    assert [r["step"] for r in held] == [3, 6] and all(len(r["acc"]) == 3 for r in held)
    assert held[-1]["positions"][0] > 0
    assert all(0.0 <= a <= 1.0 for a in held[-1]["acc"])
    assert not (run / "draft" / "tau.json").exists()  # --tau is off on the CPU by default
    assert train_recs[-1]["loss"] < train_recs[0]["loss"]  # it learns something
    assert (run / "loss.png").stat().st_size > 1000
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # the embeddings stayed the target's; the layer moved
    from safetensors import safe_open

    with safe_open(str(tiny_target.path / "model.safetensors"), "pt") as fh:
        assert torch.equal(draft.embed_tokens.weight, fh.get_tensor("model.embed_tokens.weight").float())
    # a second run into the same directory is refused unless it resumes
    res2 = CliRunner().invoke(
        app,
        [
            "train",
            "--target",
            str(tiny_target.path),
            "--data",
            str(data),
            "--out",
            str(run),
            "--online",
            "--tokens-per-batch",
            "128",
        ],
    )
    assert res2.exit_code != 0 and "--resume" in str(res2.exception)


def test_offline_store_equals_online_and_refuses_mismatches(tiny_target, data, tmp_path):
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract

    store = tmp_path / "store"
    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=store,
            layers=[1, 4, 6],
            dtype="fp32",
            device="cpu",
            model_dtype="fp32",
            progress=False,
        )
    )
    on = train(_cfg(tiny_target, data, tmp_path / "on", save_every=0))
    off = train(
        _cfg(tiny_target, data, tmp_path / "off", features="offline", store=str(store), layers=None, save_every=0)
    )
    l_on = [r["loss"] for r in _records(tmp_path / "on")]
    l_off = [r["loss"] for r in _records(tmp_path / "off")]
    assert l_on == pytest.approx(l_off, rel=1e-4, abs=1e-5)
    w_on, w_off = load_file(str(on / "model.safetensors")), load_file(str(off / "model.safetensors"))
    # the store's and the online features' fp32 rounding differ: after 4 steps a few weights differ
    # by up to about 1.5e-4 with wsd's held peak (under 1e-4 with cosine)
    for k in w_on:
        torch.testing.assert_close(w_on[k], w_off[k], atol=3e-4, rtol=1e-3)
    # another layer set
    with pytest.raises(EyasError, match=r"layers \[1, 4, 6\].*\[2, 4, 6\]"):
        train(_cfg(tiny_target, data, tmp_path / "x1", features="offline", store=str(store), layers=[2, 4, 6]))
    # a store from another target (same tokenizer and config, other weights)
    from eyas.target import resolve_target

    other = resolve_target(tiny.make_target(tmp_path / "other", "llama", seed=7))
    data2 = tiny.random_prepared(tmp_path / "data2", other)
    store2 = tmp_path / "store2"
    extract(
        ExtractConfig(
            target=str(other.path), data=data2, out=store2, layers=[1, 4, 6], dtype="fp32", device="cpu", progress=False
        )
    )
    with pytest.raises(EyasError, match="another target weights"):
        train(_cfg(tiny_target, data, tmp_path / "x2", features="offline", store=str(store2), layers=None))
    # a dataset made for the other target is refused before anything runs
    with pytest.raises(EyasError, match="another target"):
        train(_cfg(tiny_target, data2, tmp_path / "x3"))
    with pytest.raises(EyasError, match="exactly one feature source"):
        train(_cfg(tiny_target, data, tmp_path / "x4", features=None))


def _train_args(tiny_target, data, out, *extra):
    return [
        "--target",
        str(tiny_target.path),
        "--data",
        str(data),
        "--out",
        str(out),
        "--online",
        "--layers",
        "1,4,6",
        "--ttt-steps",
        "3",
        "--tokens-per-batch",
        "128",
        "--warmup",
        "2",
        "--lr",
        "2e-3",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--heldout",
        "0.1",
        "--device",
        "cpu",
        *extra,
    ]


def _train_to_end(tiny_target, data, run: Path, *args: str) -> None:
    subprocess.run(_cli(*_train_args(tiny_target, data, run, *args)), env=ENV, check=True, capture_output=True)


def _assert_same_training(run: Path, full: Path) -> None:
    """``run`` (stopped, then resumed) ends with ``full``'s weights and step losses."""
    a = load_file(str(full / "draft" / "model.safetensors"))
    b = load_file(str(run / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["loss"] for r in _records(run)] == [r["loss"] for r in _records(full)]


def _wait_for(cond, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 900  # generous: the shared CI box can be heavily loaded
    while not cond():
        assert proc.poll() is None, f"training ended before {what}"
        assert time.time() < deadline, f"no {what} within the deadline"
        time.sleep(0.02)


def test_sigkill_then_resume_equals_uninterrupted(tiny_target, data, tmp_path):
    steps = ["--max-steps", "24", "--save-every", "3"]
    full = tmp_path / "full"
    _train_to_end(tiny_target, data, full, *steps)
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        _cli(*_train_args(tiny_target, data, run, *steps)),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(lambda: any(int(p.name.split("-")[1]) >= 6 for p in checkpoint_dirs(run)), proc, "the kill's checkpoint")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "draft").exists(), "the run finished before SIGKILL; nothing was tested"
    done = [r["step"] for r in _records(run)]
    assert max(done) < 24
    _train_to_end(tiny_target, data, run, *steps, "--resume")
    # each step logged once, with the uninterrupted run's weights and losses
    assert [r["step"] for r in _records(run)] == list(range(1, 25))
    _assert_same_training(run, full)
    # changing what fixes the data order is refused on resume
    res = subprocess.run(
        _cli(*_train_args(tiny_target, data, run, "--max-steps", "30", "--seed", "5", "--resume")),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "seed" in res.stderr


def test_sigint_saves_where_it_stops_and_the_resume_equals_uninterrupted(tiny_target, data, tmp_path):
    # as a time limit's `timeout -s INT` stops a run: with --save-every 0 the only checkpoint is the
    # one the signal makes, at the step it stopped after
    steps = ["--max-steps", "24", "--save-every", "0"]
    full = tmp_path / "full"
    _train_to_end(tiny_target, data, full, *steps)
    run = tmp_path / "stopped"
    proc = subprocess.Popen(
        _cli(*_train_args(tiny_target, data, run, *steps)),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(
        lambda: (run / "metrics.jsonl").is_file() and max([r["step"] for r in _records(run)], default=0) >= 3,
        proc,
        "step 3",
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    saved = [int(p.name.split("-")[1]) for p in checkpoint_dirs(run)]
    assert len(saved) == 1 and 3 <= saved[0] < 24, (saved, err)
    assert f"stopped at step {saved[0]} of 24" in err and "Traceback" not in err
    assert max(r["step"] for r in _records(run)) == saved[0]
    assert not (run / "draft").exists()
    _train_to_end(tiny_target, data, run, *steps, "--resume")
    _assert_same_training(run, full)


def test_sigint_before_a_budget_is_planned_names_no_step_count(tiny_target, data, tmp_path):
    # a --budget run has no step count until its first steps are timed: a stop before then says
    # where it stopped, not "of" a placeholder
    run = tmp_path / "budget"
    proc = subprocess.Popen(
        _cli(*_train_args(tiny_target, data, run, "--budget", "10m", "--save-every", "0")),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: (run / "metrics.jsonl").is_file() and _records(run), proc, "step 1")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    (saved,) = [int(p.name.split("-")[1]) for p in checkpoint_dirs(run)]
    assert f"stopped at step {saved}, checkpoint saved in {run}" in err, err


def _torchrun(*args: str) -> list[str]:
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "eyas.cli",
        "train",
        *args,
    ]


def test_a_finished_run_closes_its_process_group(tiny_target, data, tmp_path, monkeypatch):
    """A torchrun rank's process group is ended when its training is done: left to the
    interpreter's exit, gloo's threads aborted a finished rank (exit -6) under load."""
    import torch.distributed as td

    from eyas.train.trainer import run

    monkeypatch.setenv("RANK", "0")
    td.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        draft = run(_cfg(tiny_target, data, tmp_path / "run", save_every=0, eval_every=0))
        assert (draft / "model.safetensors").is_file()
        assert not td.is_initialized()
    finally:
        if td.is_initialized():
            td.destroy_process_group()


def test_torchrun_two_processes_match_single_process(tiny_target, data, tmp_path):
    steps = ["--max-steps", "4", "--save-every", "0"]
    single = tmp_path / "single"
    subprocess.run(
        _cli(*_train_args(tiny_target, data, single, *steps, "--grad-accum", "2")),
        env=ENV,
        check=True,
        capture_output=True,
    )
    ddp = tmp_path / "ddp"
    res = subprocess.run(
        _torchrun(*_train_args(tiny_target, data, ddp, *steps, "--grad-accum", "1")),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    l1 = [r["loss"] for r in _records(single)]
    l2 = [r["loss"] for r in _records(ddp)]
    assert len(l1) == len(l2) == 4
    assert l1 == pytest.approx(l2, rel=1e-5)
    a = load_file(str(single / "draft" / "model.safetensors"))
    b = load_file(str(ddp / "draft" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def _resume_first_checkpoint_in_one_process(tiny_target, data, run: Path, steps, losses) -> dict:
    """Drop all but the first checkpoint of a 2-rank run, resume it in ONE process (grad-accum 2: the
    same global batch), check the losses; returns the draft's weights."""
    for later in checkpoint_dirs(run)[1:]:
        shutil.rmtree(later)
    shutil.rmtree(run / "draft")
    subprocess.run(
        _cli(*_train_args(tiny_target, data, run, *steps, "--save-every", "2", "--grad-accum", "2", "--resume")),
        env=ENV,
        check=True,
        capture_output=True,
    )
    assert [r["loss"] for r in _records(run)] == pytest.approx(losses, rel=1e-5)
    return load_file(str(run / "draft" / "model.safetensors"))


# FSDP2 runs AdamW (Muon's orthogonalisation needs whole matrices); its one-process twin must too.
ADAMW = ["--optimizer", "adamw"]


def _single_and_fsdp2(tiny_target, data, tmp_path, steps: list[str]) -> tuple[Path, Path]:
    """The same global batch twice: grad-accum 2 in one process, and FSDP2 over 2 gloo ranks (which
    checkpoints at step 2). Returns the two run directories."""
    single = tmp_path / "single"
    subprocess.run(
        _cli(*_train_args(tiny_target, data, single, *steps, "--save-every", "0", "--grad-accum", "2")),
        env=ENV,
        check=True,
        capture_output=True,
    )
    fsdp = tmp_path / "fsdp"
    res = subprocess.run(
        _torchrun(*_train_args(tiny_target, data, fsdp, *steps, "--save-every", "2", "--parallel", "fsdp2")),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return single, fsdp


def _assert_fsdp2_matches_single(single: Path, fsdp: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms (the clip norm is the whole gradient's, not one rank's shard), the
    held-out evaluation (3 batches over 2 ranks: one rank runs a padding batch, each position
    counted once) and the draft's weights agree. Returns the single run's losses and weights."""
    l1, l2 = [r["loss"] for r in _records(single)], [r["loss"] for r in _records(fsdp)]
    assert len(l1) == len(l2) == 4
    assert l1 == pytest.approx(l2, rel=1e-5)
    g1, g2 = [r["grad_norm"] for r in _records(single)], [r["grad_norm"] for r in _records(fsdp)]
    assert g1 == pytest.approx(g2, rel=1e-4)
    h1, h2 = _records(single, "heldout")[-1], _records(fsdp, "heldout")[-1]
    assert h1["positions"] == h2["positions"] and h1["loss"] == pytest.approx(h2["loss"], rel=1e-5)
    a = load_file(str(single / "draft" / "model.safetensors"))
    b = load_file(str(fsdp / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
    return l1, a


def test_fsdp2_two_processes_match_single_process(tiny_target, data, tmp_path):
    """FSDP2 (fully_shard on gloo) with the same global batch gives the single process's losses and
    weights; its checkpoint is the same full format (it resumes in one process, equal to uninterrupted)."""
    steps = ["--max-steps", "4", "--eval-batches", "3", "--heldout", "0.15", *ADAMW]  # 3 held-out packs
    single, fsdp = _single_and_fsdp2(tiny_target, data, tmp_path, steps)
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["parallel"] == "fsdp2" and summary["attention"] == "dense"  # auto on CPU
    l1, a = _assert_fsdp2_matches_single(single, fsdp)
    # the step-2 checkpoint is a full, unsharded state: optimizer ids 0..n-1 with whole tensors
    ck = checkpoint_dirs(fsdp)[0]
    assert ck.name == "step-00000002"
    w = load_file(str(ck / "model.safetensors"))
    assert w["fc.weight"].shape == a["fc.weight"].shape and w["d2t"].dtype == torch.int64
    opt = torch.load(ck / "optimizer.pt", weights_only=False)["optimizer"]
    n_train = len(opt["param_groups"][0]["params"])
    assert sorted(opt["state"]) == list(range(n_train)) and "embed_tokens.weight" not in str(opt)
    shapes = sorted(tuple(s["exp_avg"].shape) for s in opt["state"].values())
    embed_shape = (tiny_target.config()["vocab_size"], tiny_target.config()["hidden_size"])
    assert "embed_tokens.weight" not in w  # the frozen target embedding is not saved
    assert tuple(w["lm_head.weight"].shape) in shapes and embed_shape not in shapes
    # resume the fsdp2 step-2 checkpoint in ONE process (grad-accum 2: the same global batch)
    c = _resume_first_checkpoint_in_one_process(tiny_target, data, fsdp, steps, l1)
    for k in a:
        torch.testing.assert_close(a[k], c[k], atol=1e-5, rtol=1e-4)


def test_fsdp2_resumes_a_single_process_checkpoint(tiny_target, data, tmp_path):
    """The other direction: a one-process checkpoint continued by FSDP2 on 2 processes."""
    args = ["--max-steps", "4", "--save-every", "2", *ADAMW]
    full = tmp_path / "full"
    subprocess.run(
        _cli(*_train_args(tiny_target, data, full, *args, "--grad-accum", "2")),
        env=ENV,
        check=True,
        capture_output=True,
    )
    run = tmp_path / "run"
    subprocess.run(
        _cli(
            *_train_args(tiny_target, data, run, "--max-steps", "2", "--save-every", "2", "--grad-accum", "2", *ADAMW)
        ),
        env=ENV,
        check=True,
        capture_output=True,
    )
    shutil.rmtree(run / "draft")
    res = subprocess.run(
        _torchrun(*_train_args(tiny_target, data, run, *args, "--parallel", "fsdp2", "--resume")),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["parallel"] == "fsdp2"
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4]
    assert [r["loss"] for r in _records(run)] == pytest.approx([r["loss"] for r in _records(full)], rel=1e-5)
    a = load_file(str(full / "draft" / "model.safetensors"))
    b = load_file(str(run / "draft" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_drafts_and_checkpoints_leave_out_the_target_embedding(tiny_target, data, tmp_path):
    """Neither RUN/draft nor a checkpoint holds the frozen target embedding: it is read back from the
    target the draft recorded, or the one passed."""
    from safetensors import safe_open

    from eyas.draft.model import Eagle3Draft

    run = tmp_path / "new"
    train(_cfg(tiny_target, data, run, eval_every=0))
    with safe_open(str(tiny_target.path / "model.safetensors"), "pt") as fh:
        embed = fh.get_tensor("model.embed_tokens.weight").float()
    for ck in [run / "draft", *checkpoint_dirs(run)]:
        assert "embed_tokens.weight" not in load_file(str(ck / "model.safetensors")), ck
    assert torch.equal(Eagle3Draft.from_pretrained(run / "draft").embed_tokens.weight, embed)
    # a draft without a recorded target cannot find its embedding: said so, naming what to pass
    cfg = json.loads((run / "draft" / "config.json").read_text())
    (run / "draft" / "config.json").write_text(json.dumps({**cfg, "target_name_or_path": ""}))
    with pytest.raises(EyasError, match="holds no embedding.*pass the target"):
        Eagle3Draft.from_pretrained(run / "draft")
    assert torch.equal(
        Eagle3Draft.from_pretrained(run / "draft", target_dir=tiny_target.path).embed_tokens.weight, embed
    )


def test_flex_attention_cannot_train_on_cpu(tiny_target, data, tmp_path):
    """torch has no flex-attention backward on CPU: refused up front, before anything is written."""
    with pytest.raises(EyasError, match="--attention flex on cpu.*no backward"):
        train(_cfg(tiny_target, data, tmp_path / "r", attention="flex", device="cpu"))
    assert not (tmp_path / "r").exists()
    with pytest.raises(EyasError, match="--attention 'fused'"):
        train(_cfg(tiny_target, data, tmp_path / "r", attention="fused", device="cpu"))


@pytest.mark.parametrize("scope,fused", [("model", False), ("regions", False), ("model", True)])
def test_compiled_training_matches_eager(tiny_target, data, tmp_path, scope, fused):
    """--compile in either scope, and with --fused-loss, trains to the eager run's losses and
    held-out accuracies (fp32 on CPU: the compiled kernels only reorder sums); an unknown scope is
    refused before any work."""
    kw = dict(device="cpu", precision="fp32", max_steps=3, save_every=0, eval_every=0)
    eager = train(_cfg(tiny_target, data, tmp_path / "eager", **kw))
    comp = train(
        _cfg(
            tiny_target,
            data,
            tmp_path / scope,
            compile=True,
            compile_scope=scope,
            fused_loss=fused,
            experimental=scope == "regions",
            **kw,
        )
    )
    assert [r["loss"] for r in _records(comp.parent)] == pytest.approx(
        [r["loss"] for r in _records(eager.parent)], rel=1e-4
    )
    assert _records(comp.parent, "heldout")[-1]["acc"] == pytest.approx(
        _records(eager.parent, "heldout")[-1]["acc"], abs=1e-6
    )
    with pytest.raises(EyasError, match="--compile-scope 'graph'"):
        train(_cfg(tiny_target, data, tmp_path / "bad", compile=True, compile_scope="graph", **kw))
    assert not (tmp_path / "bad").exists()


def test_muon_optimizer_resumes_exactly_and_differs_from_adamw(tiny_target, data, tmp_path):
    """--optimizer muon (the default): Muon on the hidden matrices, AdamW on lm_head/norms; both states are
    checkpointed, so resuming the step-2 checkpoint ends equal to the uninterrupted run."""
    from eyas.train.optim import muon_split

    full = tmp_path / "muon"
    train(_cfg(tiny_target, data, full, optimizer="muon", eval_every=0))
    opt = torch.load(checkpoint_dirs(full)[-1] / "optimizer.pt", weights_only=False)
    muon_state, adamw_state = opt["optimizer"]["optimizers"]
    assert len(muon_state["state"]) > 0 and len(adamw_state["state"]) > 0
    assert "momentum_buffer" in next(iter(muon_state["state"].values()))
    assert "exp_avg" in next(iter(adamw_state["state"].values()))
    # resume from step 2: copy the run, drop what came after
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "draft")
    for ck in checkpoint_dirs(part):
        if int(ck.name.split("-")[1]) > 2:
            shutil.rmtree(ck)
    train(_cfg(tiny_target, data, part, optimizer="muon", eval_every=0, resume=True))
    a = load_file(str(full / "draft" / "model.safetensors"))
    b = load_file(str(part / "draft" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # another optimizer is refused on resume
    with pytest.raises(EyasError, match="optimizer"):
        train(_cfg(tiny_target, data, part, optimizer="adamw", eval_every=0, resume=True, max_steps=6))
    # and so is the same data prepared again into another dataset (here: its id), naming the cause
    other = tmp_path / "other-data"
    shutil.copytree(data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "id": "0" * 16}))
    with pytest.raises(EyasError, match=r"dataset_id: .* there, '0{16}' now\. The prepared data differ"):
        train(_cfg(tiny_target, other, part, optimizer="muon", eval_every=0, resume=True, max_steps=6))
    # and AdamW trains to other weights (the option is not ignored); lm_head is on AdamW in both
    adamw = tmp_path / "adamw"
    train(_cfg(tiny_target, data, adamw, optimizer="adamw", eval_every=0))
    c = load_file(str(adamw / "draft" / "model.safetensors"))
    assert not torch.allclose(a["midlayer.mlp.down_proj.weight"], c["midlayer.mlp.down_proj.weight"])
    from eyas.draft.model import DraftConfig, Eagle3Draft

    draft = Eagle3Draft(DraftConfig.from_dict(json.loads((full / "draft" / "config.json").read_text())))
    muon, rest = muon_split(draft)
    names = {id(p): n for n, p in draft.named_parameters()}
    assert all(p.ndim == 2 for p in muon) and "fc.weight" in {names[id(p)] for p in muon}
    assert {names[id(p)] for p in rest} >= {"lm_head.weight", "norm.weight"}


def test_a_budget_plans_the_steps_so_the_lr_reaches_its_floor_at_the_last_step(tiny_target, data, tmp_path):
    """--budget: no step count given, the first steps are timed, and the run is planned so that the
    decay ends with the budget: the last step applies the floor LR, the summary has the plan and
    the steps' time near the budget, and the data wraps into as many epochs as it takes."""
    from eyas.draft.model import Eagle3Draft

    from eyas.train.budget import MASKED_LOOPS_PASSES

    run = tmp_path / "run"
    lr, floor = 1e-3, 0.1
    # the same samples, recorded as prepared with masked loops: the warning's hint reads the manifest
    masked = tiny.random_prepared(tmp_path / "masked", tiny_target, extra_manifest={"settings": {"mask_loops": True}})
    # and as having skipped conversations that start with the assistant, which the hint then counts
    manifest = json.loads((masked / "manifest.json").read_text())
    manifest["counts"]["dropped"] = {"starts_with_assistant": 1234}
    (masked / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=r"plans \d+\.\d passes over the training split") as got:
        train(
            _cfg(
                tiny_target,
                masked,
                run,
                max_steps=None,
                budget="3s",
                lr=lr,
                min_lr_ratio=floor,
                warmup=2,
                save_every=0,
                eval_every=0,
            )
        )
    warned = [str(w.message) for w in got if "passes over the training split" in str(w.message)]
    assert len(warned) == 1  # once, not at the replan too
    summary = json.loads((run / "summary.json").read_text())
    recs = _records(run)
    steps = summary["steps"]
    plan = summary["plan"]
    assert ("--no-mask-loops" in warned[0]) == (plan["plan"]["epochs"] > MASKED_LOOPS_PASSES)
    assert "--leading-assistant trim, which keeps the 1,234 conversations" in warned[0]
    assert plan["replan"]["steps"] == steps and summary["budget_s"] == 3.0  # checked at half the budget
    assert plan["plan"]["at_step"] < plan["replan"]["at_step"] < steps and steps > 10
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert recs[-1]["lr"] == pytest.approx(lr * floor, rel=1e-6)  # the annealed draft
    assert recs[1]["lr"] == pytest.approx(lr)  # after warmup, the peak until the plan
    assert all(a["lr"] >= b["lr"] - 1e-12 for a, b in zip(recs[2:], recs[3:]))  # then only down
    # the steps' time is the budget's: the plan from the timed steps, give or take their jitter
    assert 1.5 < summary["steps_s"] < 6.0, summary
    assert summary["epochs"] > 1  # the tiny split is passed over more than once
    assert plan["replan"]["epochs"] == pytest.approx(summary["epochs"], abs=1e-3)  # the plan's passes, as run
    Eagle3Draft.from_pretrained(run / "draft")


def test_a_run_resumed_near_the_replan_times_its_own_steps_before_replanning():
    """The replan at REPLAN_AT of the budget judges the pace of this process's steps. A run resumed
    just before that point waits until it has timed its steps as long as a plan does, or a quarter of
    the budget left where that is shorter; a run not resumed replans at the point itself."""
    import time

    from eyas.train.budget import REPLAN_AT, BudgetPlanner, TrainClock
    from eyas.train.optim import Schedule

    budget = 600.0
    planner = BudgetPlanner(budget, cap=None)
    sched = Schedule("wsd", 50, 1 << 62, 0.1, decay_from=1 << 62)
    sched.plan(9800, at_step=300)
    half = REPLAN_AT * budget

    def clock(before: float, this_run: float) -> TrainClock:
        c = TrainClock(offset=before)
        c.start(5000)
        c.t0 = time.perf_counter() - this_run
        return c

    assert planner.due(clock(half - 1.0, 0.5), sched) is None  # not at the point yet
    assert planner.due(clock(half - 1.0, 2.0), sched) is None  # past it, but 2 s of this run's steps
    assert planner.due(clock(half - 1.0, planner.measure_s() + 0.5), sched) == "replan"
    assert planner.due(clock(0.0, half + 0.5), sched) == "replan"  # not resumed: at the point
    # resumed with 10 s left (on other devices, its replan undone): timed for a quarter of what is
    # left, not a plan's 18 s, by which a faster machine would have run past the old plan's end
    assert planner.measure_s() > 10.0
    assert planner.due(clock(budget - 10.0, 2.0), sched) is None
    assert planner.due(clock(budget - 10.0, 3.0), sched) == "replan"
    sched.replan(9700, at_step=5100)
    assert planner.due(clock(0.0, half + 5.0), sched) is None  # once a run


def test_a_plan_of_many_passes_warns_and_a_plan_of_few_does_not():
    from eyas.train.budget import MANY_PASSES, MASKED_LOOPS_PASSES, many_passes

    assert many_passes(MANY_PASSES, 300) is None and many_passes(1.3, 300) is None
    msg = many_passes(28.6, 300)
    assert "--budget 300s plans 28.6 passes" in msg and "--max-samples" in msg
    # on masked data the hint comes only past the passes where masks were measured to lose
    assert "--no-mask-loops" not in msg and "--no-mask-loops" in many_passes(28.6, 300, masked_loops=True)
    assert "--no-mask-loops" not in many_passes(MASKED_LOOPS_PASSES, 300, masked_loops=True)
    assert "--leading-assistant" not in msg and "keeps the 6,308 conversations" in many_passes(
        28.6, 300, skipped_leading=6308
    )


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_each_schedule_warms_up_then_ends_at_the_floor_on_the_last_step(kind):
    """Schedule: linear warmup to the peak, the decay of its kind, the floor exactly on the last step
    (step total - 1), never below it; wsd holds the peak until its last decay_fraction of steps."""
    from eyas.train.optim import Schedule

    total, warmup, floor = 100, 10, 0.1
    f = Schedule(kind, warmup, total, floor, decay_fraction=0.2)
    vals = [f(s) for s in range(total)]
    assert vals[0] == pytest.approx(1 / warmup) and vals[warmup - 1] == pytest.approx(1.0)
    assert vals[-1] == pytest.approx(floor) and min(vals[warmup:]) == pytest.approx(floor)
    assert all(a >= b for a, b in zip(vals[warmup:], vals[warmup + 1 :]))
    if kind == "wsd":
        assert vals[total - 20] == 1.0 and vals[total - 15] < 1.0
    # a run too short for decay_fraction to round to a step still ends at the floor
    short = Schedule(kind, 2, 4, floor, decay_fraction=0.2)
    assert short(1) == 1.0 and short(3) == pytest.approx(floor)
    # a plan made later (--budget) decays from the plan's step to the new end
    g = Schedule(kind, warmup, 1 << 62, floor, decay_from=1 << 62)
    assert g(50) == 1.0
    g.plan(80, at_step=40)
    assert g(39) == 1.0 and g(79) == pytest.approx(floor) and g(78) < 1.0


def test_a_run_resumed_with_more_steps_decays_to_its_new_end(tiny_target, data, tmp_path):
    """--resume with a larger --max-steps: the checkpoint's scheduler state holds the shorter run's
    length, and the LR follows the longer run's schedule from there, as if it had been planned so."""
    full = train(_cfg(tiny_target, data, tmp_path / "full", max_steps=6, warmup=2, save_every=0, eval_every=0))
    train(_cfg(tiny_target, data, tmp_path / "run", max_steps=3, warmup=2, save_every=3, eval_every=0))
    run = train(
        _cfg(tiny_target, data, tmp_path / "run", max_steps=6, warmup=2, save_every=3, eval_every=0, resume=True)
    )
    lr_full = [r["lr"] for r in _records(full.parent)]
    assert [r["lr"] for r in _records(run.parent)] == pytest.approx(lr_full)
    assert lr_full[-1] == pytest.approx(1e-3 * 0.1)  # _cfg's lr at the default min_lr_ratio, on the last step


def _killed_after_the_replan(run: Path) -> Path:
    """``run`` as if killed just after its replan: the first checkpoint past it is kept, the later
    ones and the draft dropped. Returns the kept checkpoint."""
    replanned_at = json.loads((run / "summary.json").read_text())["plan"]["replan"]["at_step"]
    kept = [c for c in checkpoint_dirs(run) if int(c.name.split("-")[1]) > replanned_at][0]
    for c in checkpoint_dirs(run):
        if c != kept:
            shutil.rmtree(c)
    shutil.rmtree(run / "draft")
    return kept


def test_a_budget_run_killed_and_resumed_keeps_its_plan(tiny_target, data, tmp_path):
    """The plan lives in the checkpoint (the scheduler's state): a run resumed after its plan
    ends at the same step with the same LR at every step, whatever the resumed run's timing."""
    run = tmp_path / "run"
    kw = dict(max_steps=None, budget="2s", warmup=2, save_every=5, eval_every=0, keep_checkpoints=0)
    train(_cfg(tiny_target, data, run, **kw))
    full = _records(run)
    steps = json.loads((run / "summary.json").read_text())["steps"]
    _killed_after_the_replan(run)
    train(_cfg(tiny_target, data, run, resume=True, **kw))
    again = _records(run)
    assert json.loads((run / "summary.json").read_text())["steps"] == steps
    assert [r["lr"] for r in again] == [r["lr"] for r in full]


def test_a_budget_run_resumed_on_other_devices_plans_its_end_again(tiny_target, data, tmp_path, capfd):
    """A checkpoint written after the replan on other devices (its trainer_state.json says so):
    the resumed run times its own steps, replans once more, and still ends annealed at the floor,
    the LR never jumping up. A checkpoint of before this record (no devices) keeps its plan."""
    from eyas.train.budget import BudgetPlanner
    from eyas.train.optim import Schedule

    run = tmp_path / "run"
    lr, floor = 1e-3, 0.1
    kw = dict(
        max_steps=None, budget="3s", warmup=2, save_every=5, eval_every=0, keep_checkpoints=0, lr=lr, min_lr_ratio=floor
    )
    train(_cfg(tiny_target, data, run, **kw))
    kept = _killed_after_the_replan(run)
    state = json.loads((kept / "trainer_state.json").read_text())
    assert state["devices"].startswith("1 x cpu")  # where it was written
    state["devices"] = "1 x NVIDIA H100 80GB HBM3"
    (kept / "trainer_state.json").write_text(json.dumps(state))
    capfd.readouterr()
    train(_cfg(tiny_target, data, run, resume=True, **kw))
    assert "not 1 x NVIDIA H100 80GB HBM3 as checkpointed" in capfd.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    plan, at = summary["plan"], int(kept.name.split("-")[1])
    moved = plan["resumed_elsewhere"]
    assert moved["at_step"] == at and moved["from"] == "1 x NVIDIA H100 80GB HBM3" and moved["on"].startswith("1 x cpu")
    assert plan["replan"]["at_step"] > at and plan["replan"]["steps"] == summary["steps"]
    recs = _records(run)
    assert recs[-1]["step"] == summary["steps"] and recs[-1]["lr"] == pytest.approx(lr * floor, rel=1e-6)
    after = [r["lr"] for r in recs if r["step"] > at]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))
    # the rule itself: no record of the devices (an older checkpoint), or the same ones, keep the plan
    sched = Schedule("wsd", 2, 100, floor)
    sched.plan(100, at_step=10)
    sched.replan(90, at_step=50)
    assert not BudgetPlanner.resumed_elsewhere(sched, None, "1 x cpu") and sched.replanned_at == 50
    assert not BudgetPlanner.resumed_elsewhere(sched, "1 x cpu", "1 x cpu") and sched.replanned_at == 50


def test_fused_loss_trains_like_the_unfused_loss_single_and_ddp(tiny_target, data, tmp_path):
    """--fused-loss: the same losses and weights as the default loss, in one process and under
    torchrun DDP (lm_head gets its gradient outside the DDP module's forward). Adam moves every
    weight by far more than the tolerance in 4 steps, so a missing gradient (lm_head's) fails."""
    steps = ["--max-steps", "4", "--save-every", "0", *ADAMW]
    runs = {"plain": (_cli, []), "fused": (_cli, ["--fused-loss"]), "fused_ddp": (_torchrun, ["--fused-loss"])}
    for name, (cmd, extra) in runs.items():
        accum = ["--grad-accum", "1" if cmd is _torchrun else "2"]
        res = subprocess.run(
            cmd(*_train_args(tiny_target, data, tmp_path / name, *steps, *accum, *extra)),
            env=ENV,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr[-3000:]
    losses = {n: [r["loss"] for r in _records(tmp_path / n)] for n in runs}
    assert len(losses["plain"]) == 4
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-5)
    assert losses["fused_ddp"] == pytest.approx(losses["plain"], rel=1e-5)
    # the held-out loss and agreement are the same too
    held = {n: _records(tmp_path / n, "heldout")[-1] for n in runs}
    for n in ("fused", "fused_ddp"):
        for key in ("loss", "acc", "positions"):
            assert held[n][key] == pytest.approx(held["plain"][key], rel=1e-5), (n, key)
    ref = load_file(str(tmp_path / "plain" / "draft" / "model.safetensors"))
    for n in ("fused", "fused_ddp"):
        got = load_file(str(tmp_path / n / "draft" / "model.safetensors"))
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4, msg=f"{n}: {k}")


def test_fsdp2_fused_loss_matches_single_process(tiny_target, data, tmp_path):
    """--fused-loss --parallel fsdp2: lm_head stays sharded (each rank scores its vocab rows for
    every rank's positions, eyas.draft.sharded_loss), and 2 gloo ranks give the single-process
    fused loss's losses, gradient norms, held-out numbers, checkpoint and trained weights (the same
    global batch: grad-accum 2 in one process). Adam moves lm_head by far more than the tolerance,
    so a wrong or missing shard gradient fails. It resumes in one process like any FSDP2 run."""
    steps = [
        "--max-steps",
        "4",
        "--eval-batches",
        "3",
        "--heldout",
        "0.15",
        "--fused-loss",
        "--loss-chunk",
        "7",
        *ADAMW,
    ]
    single, fsdp = _single_and_fsdp2(tiny_target, data, tmp_path, steps)
    assert json.loads((fsdp / "summary.json").read_text())["parallel"] == "fsdp2"
    l1, a = _assert_fsdp2_matches_single(single, fsdp)
    assert [r["acc"] for r in _records(single)] == [r["acc"] for r in _records(fsdp)]
    # the checkpoint is full (lm_head whole, its AdamW state too) and resumes in one process
    w = load_file(str(checkpoint_dirs(fsdp)[0] / "model.safetensors"))
    assert w["lm_head.weight"].shape == a["lm_head.weight"].shape
    c = _resume_first_checkpoint_in_one_process(tiny_target, data, fsdp, steps, l1)
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


def test_log_every_keeps_every_nth_record_and_its_numbers(tiny_target, data, tmp_path):
    """--log-every 3 writes steps 3, 6 and the last, each with the numbers the per-step run logged
    at that step (a step's numbers are read from the device one step late; none may be lost or
    shifted); bad settings are refused before any work."""
    kw = dict(device="cpu", precision="fp32", max_steps=7, save_every=0, eval_every=0)
    train(_cfg(tiny_target, data, tmp_path / "every", **kw))
    train(_cfg(tiny_target, data, tmp_path / "third", log_every=3, **kw))
    every = {r["step"]: r for r in _records(tmp_path / "every")}
    third = _records(tmp_path / "third")
    assert [r["step"] for r in third] == [3, 6, 7]
    for r in third:
        ref = every[r["step"]]
        assert r["tokens"] == ref["tokens"] and r["lr"] == ref["lr"]
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert r["acc"] == pytest.approx(ref["acc"], abs=1e-9)
    summary = json.loads((tmp_path / "third" / "summary.json").read_text())
    assert summary["tokens_seen"] == every[7]["tokens"]
    for bad, match in (
        (dict(log_every=0), "--log-every 0"),
        (dict(compile_mode="fast"), "--compile-mode 'fast'"),
        (dict(loss_chunk=0), "--loss-chunk 0"),
    ):
        with pytest.raises(EyasError, match=match):
            train(_cfg(tiny_target, data, tmp_path / "bad", **{**kw, **bad}))
        assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the copy stream and pinned memory)")
def test_offline_batches_copied_on_a_side_stream_equal_the_host_ones(tiny_target, data, tmp_path):
    """On CUDA the store's batches reach the device on a copy stream of their own, read ahead by a
    background thread; the training stream must see exactly the host's tensors, also when it is
    busy while they are copied."""
    from eyas.data.dataset import open_prepared
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract
    from eyas.target import resolve_target
    from eyas.train.features import OfflineFeatures
    from eyas.train.packing import pack_indices

    store = tmp_path / "store"
    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=store,
            layers=[1, 4, 6],
            dtype="fp32",
            device="cpu",
            model_dtype="fp32",
            progress=False,
        )
    )
    target, ds = (
        resolve_target(str(tiny_target.path)),
        open_prepared(data, target=resolve_target(str(tiny_target.path))),
    )
    packs = pack_indices(np.arange(len(ds)), ds.lengths, 128, seed=0)
    batches = [packs[i : i + 2] for i in range(0, 8, 2)]
    cpu = OfflineFeatures(store, target, ds, None, torch.device("cpu"), torch.float32, 128)
    gpu = OfflineFeatures(store, target, ds, None, torch.device("cuda"), torch.float32, 128)
    busy = torch.randn(4096, 4096, device="cuda")
    got = []
    for i, b in enumerate(batches):
        if i + 1 < len(batches):
            gpu.prefetch(batches[i + 1])
        for _ in range(20):  # keep the training stream busy while the next batch is copied
            busy = busy @ busy / busy.norm()
        x = gpu.batch(b)
        got.append(
            {k: getattr(x, k).clone() for k in ("input_ids", "loss_mask", "position_ids", "doc_ids", "aux", "final")}
        )
    for b, g in zip(batches, got):
        ref = cpu.batch(b)
        for k, v in g.items():
            assert torch.equal(v.cpu(), getattr(ref, k)), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (TF32 is a CUDA matmul setting)")
@pytest.mark.parametrize("before", [False, True])
def test_a_cuda_run_leaves_tf32_as_it_found_it(tiny_target, data, tmp_path, before):
    """A CUDA run trains with TF32 matmuls, and the process gets its own setting back: an fp32 CUDA
    extraction after a training in the same process once quantized other features than alone."""
    was, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, before
    try:
        train(_cfg(tiny_target, data, tmp_path / "run", device="cuda", compile=False, tau=False, max_steps=2))
        assert torch.backends.cuda.matmul.allow_tf32 is before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was  # the next tests' setting, as this one found it
