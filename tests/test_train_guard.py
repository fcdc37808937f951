"""Non-finite training never passes silently: skipped steps, a named stop, no NaN draft (issue 16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.errors import NonFiniteError
from eyas.train.checkpoint import checkpoint_dirs
from eyas.train.guard import NonFiniteGuard
from eyas.train.trainer import run as train
from test_train_run import _cfg, _records, data  # noqa: F401  (the module's prepared-data fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _poison(monkeypatch, calls: set[int]) -> None:
    """NaN aux states in the training batches whose call number (from 1) is in ``calls``."""
    from eyas.train import features

    real = features.OnlineFeatures.batch
    seen = {"n": 0}

    def batch(self, packs):
        b = real(self, packs)
        seen["n"] += 1
        if seen["n"] in calls:
            b.aux = torch.full_like(b.aux, float("nan"))
        return b

    monkeypatch.setattr(features.OnlineFeatures, "batch", batch)


def _state(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def test_one_nonfinite_batch_is_skipped_counted_and_not_applied(tiny_target, data, tmp_path, monkeypatch):
    _poison(monkeypatch, {3})
    run = tmp_path / "run"
    draft = train(_cfg(tiny_target, data, run, max_steps=5, save_every=1, eval_every=0, keep_checkpoints=10))
    recs = {r["step"]: r for r in _records(run)}
    assert recs[3]["finite"] is False and recs[3]["skipped_steps"] == 1
    assert all(recs[s]["finite"] for s in (1, 2, 4, 5)) and recs[5]["skipped_steps"] == 1
    assert json.loads((run / "summary.json").read_text())["skipped_nonfinite_steps"] == 1
    # the skipped step changed nothing: step 3's weights are step 2's, step 4 moved on
    s2, s3, s4 = (_state(run / "checkpoints" / f"step-{s:08d}") for s in (2, 3, 4))
    assert all(torch.equal(s2[k], s3[k]) for k in s2)
    assert any(not torch.equal(s3[k], s4[k]) for k in s3 if s3[k].is_floating_point())
    weights = load_file(str(draft / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def test_repeated_nonfinite_steps_stop_naming_step_samples_and_ttt_step(tiny_target, data, tmp_path, monkeypatch):
    _poison(monkeypatch, set(range(3, 100)))
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError) as e:
        train(_cfg(tiny_target, data, run, max_steps=10, save_every=2, eval_every=0, keep_checkpoints=10))
    msg = str(e.value)
    assert "3 steps in a row (3, 4, 5)" in msg and "step 3" in msg and "TTT step 0" in msg
    assert "dataset samples [" in msg and "--resume" in msg
    assert not (run / "draft").exists()
    ckpts = checkpoint_dirs(run)
    assert [c.name for c in ckpts] == ["step-00000002", "step-00000004"]
    # the newest checkpoint (a skipped step) still holds step 2's finite weights
    s2, s4 = _state(ckpts[0]), _state(ckpts[1])
    assert all(torch.equal(s2[k], s4[k]) for k in s2)
    # and --resume starts there once the data is sound again
    monkeypatch.undo()
    draft = train(_cfg(tiny_target, data, run, max_steps=10, save_every=2, eval_every=0, resume=True))
    assert [r["step"] for r in _records(run)][-6:] == [5, 6, 7, 8, 9, 10]
    assert (draft / "model.safetensors").is_file()


def test_exploding_learning_rate_stops_and_leaves_no_nan_draft(tiny_target, data, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError) as e:
        train(
            _cfg(
                tiny_target,
                data,
                run,
                max_steps=12,
                save_every=1,
                eval_every=0,
                lr=1e36,
                warmup=1,
                clip=0.0,
                keep_checkpoints=20,
            )
        )
    assert "non-finite" in str(e.value)
    assert not (run / "draft").exists()
    for c in checkpoint_dirs(run):
        assert all(torch.isfinite(t).all() for t in _state(c).values() if t.is_floating_point()), c


def test_fused_adamw_skip_happens_on_the_device_without_touching_state():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    guard = NonFiniteGuard(opt, limit=3)
    assert guard.on_device
    p.grad = torch.full((4,), float("nan"))
    finite = guard.step(torch.tensor(1.0), torch.tensor(float("nan")))
    assert not bool(finite) and torch.equal(p.detach(), torch.ones(4))
    assert not opt.state or float(opt.state[p]["step"]) == 0.0
    p.grad = torch.ones(4)
    assert bool(guard.step(torch.tensor(1.0), torch.tensor(2.0)))
    assert (p.detach() < 1).all() and float(opt.state[p]["step"]) == 1.0


def _nan_draft(tmp_path: Path) -> Path:
    cfg = DraftConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=100,
        draft_vocab_size=50,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=32,
    )
    d = Eagle3Draft(cfg).save_pretrained(tmp_path / "draft")
    w = load_file(str(d / "model.safetensors"))
    w["midlayer.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(w, str(d / "model.safetensors"))
    return d


def test_nan_weights_are_never_saved_loaded_or_exported(tmp_path):
    cfg = DraftConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=100,
        draft_vocab_size=50,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=32,
    )
    m = Eagle3Draft(cfg)
    with torch.no_grad():
        m.fc.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="'fc.weight'"):
        m.save_pretrained(tmp_path / "never")
    assert not (tmp_path / "never").exists()
    d = _nan_draft(tmp_path)
    with pytest.raises(NonFiniteError, match="'midlayer.mlp.up_proj.weight' has 1 non-finite"):
        Eagle3Draft.from_pretrained(d)
    res = subprocess.run(
        [sys.executable, "-m", "eyas.cli", "export", str(d), "--format", "vllm", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "midlayer.mlp.up_proj.weight" in res.stderr, res.stderr
    assert not (tmp_path / "x").exists()


def test_the_cli_shows_eyas_warnings_as_one_line_and_others_as_python_does(capsys):
    """A skipped step's warning, as `eyas train` prints it: ``warning: ...`` alone, without Python's
    file, line and calling source line; a warning from outside eyas goes on to Python's display."""
    import warnings

    from eyas.errors import show_warning

    guard = NonFiniteGuard(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), limit=3)
    with pytest.warns(UserWarning, match="a warning from outside eyas") as passed_on:
        warnings.showwarning = show_warning  # as `eyas` (cli.main) sets it
        guard.record(False, 7, {"step_loss": [1.0, float("nan")]})
        warnings.warn("a warning from outside eyas", UserWarning, stacklevel=1)
    assert capsys.readouterr().err.splitlines() == [
        "warning: step 7: non-finite loss (TTT step 1 first); the optimizer step was skipped "
        "(1 in a row, the run stops at 3)"
    ]
    assert [str(w.message) for w in passed_on] == ["a warning from outside eyas"]
