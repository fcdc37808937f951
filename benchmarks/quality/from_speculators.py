"""Turn a speculators 0.9.0 EAGLE-3 checkpoint into a draft that eyas's evaluation loop runs.

speculators saves ``DIR/config.json`` (``Eagle3SpeculatorConfig``: ``transformer_layer_config``
+ flags) and ``DIR/model.safetensors`` with ``layers.0.*`` for the one decoder layer. eyas's
draft (interface C) names it ``midlayer.*``; the rest (``fc``, ``norm``, ``lm_head``, ``d2t``,
``t2d``, ``embed_tokens``) keeps its name.

0.9.0's EAGLE-3 defaults (``norm_before_fc``, ``norm_output``, ``norm_before_residual``) and its ``fc_norm`` are
DraftConfig options of eyas's own head, so the result is a plain eyas checkpoint: ``eyas
evaluate``, ``eyas export`` and ``Eagle3Draft.from_pretrained`` take it as it is.

Usage: python from_speculators.py --ckpt SPEC_DIR --target TARGET_HF_DIR --out DRAFT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.errors import EyasError


def draft_config_from_speculators(spec_cfg: dict[str, Any], target_dir: Path) -> DraftConfig:
    """eyas DraftConfig with the shapes of the speculators checkpoint and the target's facts."""
    tl = spec_cfg["transformer_layer_config"]
    target_cfg = json.loads((target_dir / "config.json").read_text())
    if tl.get("model_type", "llama") != "llama":
        raise EyasError(f"speculators draft layer type {tl.get('model_type')!r}: only llama converts")
    if int(tl.get("num_hidden_layers", 1)) != 1:
        raise EyasError(f"speculators draft has {tl.get('num_hidden_layers')} layers; eyas's head has one")
    aux = spec_cfg.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise EyasError(
            "speculators config has no eagle_aux_hidden_state_layer_ids; pass a trained "
            "checkpoint (its trainer writes them)"
        )
    h = int(tl["hidden_size"])
    heads = int(tl["num_attention_heads"])
    rope = dict(tl.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", tl.get("rope_theta", 10000.0)))
    scaling = rope if rope and rope.get("rope_type", rope.get("type")) not in (None, "default") else None
    try:
        from eyas.target import resolve_target

        identity = resolve_target(target_dir).identity
    except Exception:  # noqa: BLE001 - identity is informative only
        identity = {}
    ttc = target_cfg.get("text_config", target_cfg)
    return DraftConfig(
        hidden_size=h,
        num_attention_heads=heads,
        num_key_value_heads=int(tl.get("num_key_value_heads") or heads),
        head_dim=int(tl.get("head_dim") or h // heads),
        intermediate_size=int(tl["intermediate_size"]),
        vocab_size=int(tl["vocab_size"]),
        draft_vocab_size=int(spec_cfg["draft_vocab_size"]),
        aux_layer_ids=[int(i) for i in aux],
        target_hidden_size=int(spec_cfg.get("target_hidden_size") or h),
        rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(tl.get("max_position_embeddings", 4096)),
        hidden_act=tl.get("hidden_act", "silu"),
        norm_before_residual=bool(spec_cfg.get("norm_before_residual", False)),
        norm_before_fc=bool(spec_cfg.get("norm_before_fc", False)),
        fc_norm=bool(spec_cfg.get("fc_norm", False)),
        norm_output=bool(spec_cfg.get("norm_output", False)),
        target_num_layers=int(ttc.get("num_hidden_layers", 0)),
        target_model_type=ttc.get("model_type", "llama"),
        target_architectures=list(target_cfg.get("architectures") or []),
        target=identity,
        target_name_or_path=str(Path(target_dir).resolve()),  # where the frozen embedding is read from
    )


def rename(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' tensor names -> eyas's (layers.0.* -> midlayer.*; verifier_* dropped)."""
    out = {}
    for k, v in state.items():
        if k.startswith("verifier_"):
            continue
        if k.startswith("layers."):
            idx, rest = k[len("layers.") :].split(".", 1)
            if idx != "0":
                raise EyasError(f"speculators tensor {k}: more than one decoder layer")
            k = "midlayer." + rest
        out[k] = v
    return out


def convert(ckpt: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write the eyas-side draft directory; returns a summary (also in ``out/conversion.json``)."""
    from safetensors.torch import load_file

    ckpt, target, out = Path(ckpt), Path(target), Path(out)
    for f in ("config.json", "model.safetensors"):
        if not (ckpt / f).is_file():
            raise EyasError(
                f"speculators checkpoint {ckpt}: {f} is missing (pass an epoch directory, "
                "e.g. SAVE_PATH/0, or SAVE_PATH/interrupted)"
            )
    spec_cfg = json.loads((ckpt / "config.json").read_text())
    if spec_cfg.get("speculators_model_type") != "eagle3":
        raise EyasError(f"{ckpt}: speculators_model_type {spec_cfg.get('speculators_model_type')!r}, expected 'eagle3'")
    cfg = draft_config_from_speculators(spec_cfg, target)
    state = rename(load_file(str(ckpt / "model.safetensors")))
    model = Eagle3Draft(cfg)
    if "embed_tokens.weight" not in state:  # frozen: the target's own
        from eyas.draft.target_weights import read_target_head

        state["embed_tokens.weight"] = read_target_head(target)["embed"]
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
    )
    if missing or unexpected:
        raise EyasError(
            f"speculators checkpoint {ckpt}: tensors missing {missing}, unexpected {unexpected} after renaming"
        )
    summary = {
        "source": str(ckpt.resolve()),
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "norm_before_residual": cfg.norm_before_residual,
        "speculators_version": spec_cfg.get("speculators_version"),
        "sliding_window": spec_cfg["transformer_layer_config"].get("sliding_window"),
    }
    model.save_pretrained(out)  # atomic: config.json + model.safetensors
    (out / "conversion.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="speculators checkpoint directory (SAVE_PATH/N).")
    ap.add_argument("--target", required=True, help="Target HF directory (the verifier).")
    ap.add_argument("--out", required=True, help="Draft directory to write.")
    a = ap.parse_args(argv)
    print(json.dumps(convert(a.ckpt, a.target, a.out), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
