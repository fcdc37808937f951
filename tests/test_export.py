"""`eyas export`: the vLLM (speculators) and SGLang directories, and the checks against the target."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

import evalkit
import tiny
from eyas.errors import EyasError
from eyas.export.cli import register
from eyas.export.config import ExportConfig
from eyas.export.run import run as run_export


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from eyas.target import resolve_target

    return resolve_target(evalkit.make_eval_target(tmp_path_factory.mktemp("exp-target")))


def _draft(
    target,
    out: Path,
    layers=(1, 3, 4),
    draft_vocab: int = 200,
    seed: int = 0,
    target_dir: Path | None = None,
    **overrides,
) -> Path:
    """A draft initialised from ``target_dir`` (default: the target) with a non-trivial d2t."""
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.target import resolve_target

    src = resolve_target(target_dir) if target_dir else target
    vocab = src.config()["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    overrides = {"target_name_or_path": str(src.path), "target_spec": src.spec, **overrides}  # as train
    cfg = DraftConfig.from_target(src.config(), list(layers), draft_vocab, src.identity, **overrides)
    draft = Eagle3Draft.from_target(cfg, src.path, ids - torch.arange(draft_vocab), t2d, seed=seed)
    return draft.save_pretrained(out)


def test_vllm_format(target, tmp_path):
    ckpt = _draft(target, tmp_path / "ckpt")
    out = run_export(
        ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "vllm", target=str(target.path), num_speculative_tokens=4)
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["draft_vocab_size"] == 200 and cfg["target_hidden_size"] == 128
    assert cfg["norm_before_residual"] is True  # eyas's default for new drafts
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == target.config()["vocab_size"]
    assert layer["head_dim"] == 32 and layer["hidden_size"] == 128
    spec = cfg["speculators_config"]
    assert spec["verifier"]["name_or_path"] == str(target.path)
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    src = load_file(str(ckpt / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in got  # vLLM shares the target's
    assert torch.equal(got["layers.0.self_attn.q_proj.weight"], src["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(got["d2t"], src["d2t"]) and got["d2t"].dtype == torch.int64
    assert torch.equal(got["t2d"], src["t2d"]) and got["t2d"].dtype == torch.bool
    assert not any(k.startswith("midlayer.") for k in got)


def test_vllm_format_with_fc_norm(target, tmp_path):
    """A draft with per-aux-layer norms exports them under the names vLLM's EAGLE-3 head loads
    (``fc_norm.{i}.weight`` -> ``model.fc_norm.{i}``) with the config switch; SGLang refuses it."""
    ckpt = _draft(target, tmp_path / "ckpt", fc_norm=True)
    out = run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "vllm", target=str(target.path)))
    assert json.loads((out / "config.json").read_text())["fc_norm"] is True
    got = load_file(str(out / "model.safetensors"))
    assert sorted(k for k in got if k.startswith("fc_norm.")) == [f"fc_norm.{i}.weight" for i in range(3)]
    plain = run_export(
        ExportConfig(
            ckpt=_draft(target, tmp_path / "c2", norm_before_residual=False),
            format="vllm",
            out=tmp_path / "v2",
            target=str(target.path),
        )
    )
    plain_cfg = json.loads((plain / "config.json").read_text())
    assert "fc_norm" not in plain_cfg  # what vLLM 0.16 reads
    assert plain_cfg["norm_before_residual"] is False  # explicit: vLLM takes True when it is absent
    with pytest.raises(EyasError, match="fc_norm"):
        run_export(ExportConfig(ckpt=ckpt, format="sglang", out=tmp_path / "sgl", target=str(target.path)))


def test_vllm_format_with_speculators_head_options(target, tmp_path):
    """norm_before_fc (one norm over the concatenated aux states: ``input_norm.weight``, which
    vLLM loads as ``model.input_norm``) and norm_output are written as vLLM's config switches."""
    ckpt = _draft(target, tmp_path / "ckpt", norm_before_fc=True, norm_output=True)
    out = run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "vllm", target=str(target.path)))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True and "fc_norm" not in cfg
    got = load_file(str(out / "model.safetensors"))
    assert got["input_norm.weight"].shape == (3 * 128,)
    with pytest.raises(EyasError, match="norm_before_fc, norm_output"):
        run_export(ExportConfig(ckpt=ckpt, format="sglang", out=tmp_path / "sgl", target=str(target.path)))
    with pytest.raises(EyasError, match="exclude each other"):
        _draft(target, tmp_path / "both", norm_before_fc=True, fc_norm=True)


def test_sglang_format_ids_in_both_conventions(target, tmp_path):
    ckpt = _draft(target, tmp_path / "ckpt")
    out = run_export(
        ExportConfig(ckpt=ckpt, format="sglang", out=tmp_path / "sgl", target=str(target.path), dtype="bfloat16")
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: input of layer k
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang: output of k
    assert cfg["torch_dtype"] == "bfloat16"
    got = load_file(str(out / "model.safetensors"))
    src = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(src) - {"embed_tokens.weight"}
    assert got["fc.weight"].dtype == torch.bfloat16 and got["d2t"].dtype == torch.int64
    assert torch.equal(got["midlayer.mlp.down_proj.weight"], src["midlayer.mlp.down_proj.weight"].bfloat16())
    # id 0 (the embeddings) has no SGLang spelling: refused, not silently shifted to -1
    with pytest.raises(EyasError, match="id 0"):
        run_export(
            ExportConfig(
                ckpt=_draft(target, tmp_path / "c0", layers=(0, 3, 4)),
                format="sglang",
                out=tmp_path / "s0",
                target=str(target.path),
            )
        )


def test_refuses_a_draft_for_another_target(target, tmp_path):
    # layer ids: a draft for a 10-layer target with ids beyond this target's 6 layers
    deep = evalkit.tiny.make_target(tmp_path / "deep", "llama", num_layers=10, hidden=128)
    ckpt = _draft(target, tmp_path / "c1", layers=(2, 5, 7), target_dir=deep)
    with pytest.raises(EyasError, match=r"layer ids \[2, 5, 7\]: \[7\] out of range") as e:
        run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "o1", target=str(target.path)))
    assert "layer count" in str(e.value)
    # hidden size: a draft for an H=64 target
    narrow = tiny.make_target(tmp_path / "narrow", "llama", num_layers=6, hidden=64)
    ckpt = _draft(target, tmp_path / "c2", target_dir=narrow)
    with pytest.raises(EyasError, match="hidden size: draft expects target_hidden_size 64"):
        run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "o2", target=str(target.path)))
    # vocab: same shapes, another vocabulary size
    other = tmp_path / "vocab"
    tiny.make_tokenizer(other, vocab_size=300)
    cfg = tiny.tiny_config("llama", vocab_size=300, num_layers=6, hidden=128)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    ckpt = _draft(target, tmp_path / "c3", target_dir=other)
    with pytest.raises(EyasError, match=r"vocab: draft maps into a vocabulary of 300"):
        run_export(ExportConfig(ckpt=ckpt, format="sglang", out=tmp_path / "o3", target=str(target.path)))
    # same shapes, other weights: the identity check names it (and can be waived)
    twin = evalkit.make_eval_target(tmp_path / "twin", seed=5)
    ckpt = _draft(target, tmp_path / "c4", target_dir=twin)
    with pytest.raises(EyasError, match="target identity.*weights"):
        run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "o4", target=str(target.path)))
    run_export(
        ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "o4", target=str(target.path), check_identity=False)
    )
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


def test_export_cli(target, tmp_path):
    ckpt = _draft(target, tmp_path / "ckpt")
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    args = ["export", str(ckpt), "--format", "sglang", "--out", str(tmp_path / "o"), "--target", str(target.path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "model.safetensors").is_file()
    res = CliRunner().invoke(app, args)  # exists: refused without --overwrite
    assert res.exit_code != 0 and "--overwrite" in str(res.exception)
    assert CliRunner().invoke(app, args + ["--overwrite"]).exit_code == 0
    res = CliRunner().invoke(app, args[:2] + ["--format", "onnx"] + args[4:] + ["--overwrite"])
    assert res.exit_code == 2 and "'onnx' is not one of 'vllm', 'sglang'" in " ".join(
        re.sub(r"[│╭╮╰╯─]", " ", res.output).split()
    )  # typer's error box, unwrapped
    (tmp_path / "not-a-draft").mkdir()
    res = CliRunner().invoke(
        app, ["export", str(tmp_path / "not-a-draft"), "--out", str(tmp_path / "x"), "--target", str(target.path)]
    )
    assert res.exit_code != 0 and "needs config.json and model.safetensors" in str(res.exception)


def test_export_without_target_uses_the_draft_and_no_network(target, tmp_path, monkeypatch):
    """No --target: the verifier comes from the draft's config; nothing is resolved or downloaded."""
    import eyas.fsio
    import eyas.target

    def no_network(*args, **kwargs):
        raise AssertionError("export tried to download a target")

    monkeypatch.setattr(eyas.fsio, "download_wheel", no_network)
    monkeypatch.setattr(eyas.target, "download_wheel", no_network)
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    monkeypatch.setenv("EYAS_CACHE", str(empty))
    ckpt = _draft(target, tmp_path / "ckpt")
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["export", str(ckpt), "--format", "vllm", "--out", str(tmp_path / "v")])
    assert res.exit_code == 0, (res.output, res.exception)
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    verifier = cfg["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target.path), "architectures": ["LlamaForCausalLM"]}
    assert not any(empty.iterdir())  # nothing was fetched or converted
    # the same directory as an export checked against the target
    checked = run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "v2", target=str(target.path)))
    assert json.loads((checked / "config.json").read_text()) == cfg
    for fmt in ("vllm", "sglang"):
        a = run_export(ExportConfig(ckpt=ckpt, format=fmt, out=tmp_path / f"{fmt}-a"))
        b = run_export(ExportConfig(ckpt=ckpt, format=fmt, out=tmp_path / f"{fmt}-b", target=str(target.path)))
        assert (a / "config.json").read_text() == (b / "config.json").read_text()
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_export_of_a_draft_without_target(target, tmp_path):
    """A draft that records no target (made through the API without one): vllm needs --target or
    --verifier."""
    ckpt = _draft(target, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(target_name_or_path="", target_spec="", target_token_ids={})
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EyasError, match="--target.*--verifier"):
        run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "v"))
    out = run_export(
        ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "v", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    )
    assert (
        json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    out = run_export(ExportConfig(ckpt=ckpt, format="vllm", out=tmp_path / "v2", target=str(target.path)))  # as before
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == str(
        target.path
    )
    run_export(ExportConfig(ckpt=ckpt, format="sglang", out=tmp_path / "s"))  # needs no verifier
