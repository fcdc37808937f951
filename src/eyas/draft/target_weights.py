"""Read only the target tensors the draft needs (embeddings, final norm, lm_head) with safe_open.

A 1T-parameter target never has to be loaded to train its draft: the weight map (or the single
safetensors file's header) says where the three tensors lie.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from eyas.errors import EyasError

_FINAL_NORM = re.compile(r"^(model\.|model\.language_model\.|language_model\.model\.)?norm\.weight$")


def _weight_map(target_dir: Path) -> dict[str, str]:
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise EyasError(
            f"target {target_dir}: no safetensors weights; the draft reads the target's "
            "embeddings and lm_head from safetensors (convert .bin checkpoints first)"
        )
    from safetensors import safe_open

    out: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f.name for k in fh.keys()})
    return out


def _pick(names: list[str], what: str, target_dir: Path) -> str:
    if not names:
        raise EyasError(
            f"target {target_dir}: found no {what} tensor in the weights; "
            "eyas supports Llama-style checkpoints (model.embed_tokens, model.norm, lm_head)"
        )
    return min(names, key=len)


def read_target_head(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """{'embed': [V,H], 'norm': [H], 'lm_head': [V,H]} in the checkpoint dtype (lm_head = embed if tied)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    wmap = _weight_map(target_dir)
    keys = list(wmap)
    embed = _pick([k for k in keys if k.endswith("embed_tokens.weight")], "embed_tokens", target_dir)
    norm = _pick([k for k in keys if _FINAL_NORM.match(k)], "final norm", target_dir)
    heads = [k for k in keys if k.endswith("lm_head.weight")]
    wanted = {"embed": embed, "norm": norm}
    if heads:
        wanted["lm_head"] = _pick(heads, "lm_head", target_dir)
    out: dict[str, torch.Tensor] = {}
    for role, key in wanted.items():
        with safe_open(str(target_dir / wmap[key]), framework="pt") as fh:
            out[role] = fh.get_tensor(key)
    if "lm_head" not in out:  # tied embeddings
        out["lm_head"] = out["embed"]
    cfg = json.loads((target_dir / "config.json").read_text())
    if cfg.get("model_type", "").startswith("gemma"):
        raise EyasError(
            f"target {target_dir}: Gemma targets scale embeddings and offset norms; "
            "the draft head does not support them yet"
        )
    return out
