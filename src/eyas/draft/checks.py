"""A trained draft as its tensors (for export and evaluation), and its check against the target it will serve.

A draft is only usable with the target whose layers, width and vocabulary it was trained on:
vLLM would otherwise fail with a shape error at best, or serve garbage drafts at worst.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError


@dataclass
class DraftCheckpoint:
    path: Path
    config: Any  # eyas.draft.model.DraftConfig
    tensors: dict[str, torch.Tensor]  # names as in Eagle3Draft.state_dict()


REQUIRED = (
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)


def load_checkpoint(path: str | Path) -> DraftCheckpoint:
    """Read ``config.json`` + ``model.safetensors`` of an eyas draft (``RUN_DIR/draft``)."""
    from eyas.draft.io import FIX, check_finite_state
    from eyas.draft.shapes import check_draft_files
    from eyas.tensorfile import load_tensors

    path = Path(path)
    cfg_path, w_path = path / "config.json", path / "model.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise EyasError(
            f"checkpoint {path}: needs config.json and model.safetensors; pass the draft "
            "directory written by `eyas train` (RUN_DIR/draft)"
        )
    # the config against the weights' header first: nothing is loaded from a file that does not fit
    cfg, _ = check_draft_files(path, "checkpoint", FIX)
    tensors = load_tensors(w_path, "checkpoint", FIX)
    check_finite_state(tensors, f"checkpoint {w_path}")
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise EyasError(
            f"checkpoint {w_path}: missing tensors {missing}; it is incomplete or not an eyas EAGLE-3 draft"
        )
    return DraftCheckpoint(path=path, config=cfg, tensors=tensors)


def check_against_target(
    ckpt: DraftCheckpoint,
    target_config: dict[str, Any],
    target_identity: dict[str, str] | None = None,
    target_name: str = "target",
    check_identity: bool = True,
) -> None:
    """Raise an EyasError naming every mismatch between the draft and the target."""
    cfg, t = ckpt.config, ckpt.tensors
    tc = target_config.get("text_config", target_config)
    n_layers, hidden, vocab = tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"]
    problems: list[str] = []
    ids = list(cfg.aux_layer_ids)
    bad = [k for k in ids if not 0 <= k < n_layers]
    if bad:
        problems.append(f"layer ids {ids}: {bad} out of range for a target with {n_layers} layers")
    if len(set(ids)) != len(ids):
        problems.append(f"layer ids {ids} contain duplicates")
    if cfg.target_num_layers and cfg.target_num_layers != n_layers:
        problems.append(
            f"layer count: draft trained on a {cfg.target_num_layers}-layer target, {target_name} has {n_layers}"
        )
    if cfg.target_hidden_size != hidden:
        problems.append(
            f"hidden size: draft expects target_hidden_size {cfg.target_hidden_size}, {target_name} has {hidden}"
        )
    if t["fc.weight"].shape[1] != len(ids) * hidden:
        problems.append(
            f"hidden size: fc.weight takes {t['fc.weight'].shape[1]} inputs, "
            f"{len(ids)} aux layers x {hidden} = {len(ids) * hidden} needed"
        )
    if cfg.vocab_size != vocab:
        problems.append(f"vocab: draft maps into a vocabulary of {cfg.vocab_size}, {target_name} has {vocab}")
    d2t = t["d2t"].to(torch.long)
    mapped = torch.arange(d2t.numel()) + d2t
    if d2t.numel() != cfg.draft_vocab_size or t["lm_head.weight"].shape[0] != cfg.draft_vocab_size:
        problems.append(
            f"vocab: draft_vocab_size {cfg.draft_vocab_size}, d2t has {d2t.numel()} "
            f"entries, lm_head has {t['lm_head.weight'].shape[0]} rows"
        )
    elif mapped.numel() and (int(mapped.min()) < 0 or int(mapped.max()) >= vocab):
        problems.append(
            f"vocab: d2t maps draft ids to target ids {int(mapped.min())}..{int(mapped.max())}, "
            f"outside {target_name}'s 0..{vocab - 1}"
        )
    if check_identity and target_identity and cfg.target:
        diff = [k for k in ("config", "weights", "tokenizer") if cfg.target.get(k) != target_identity.get(k)]
        if diff:
            from eyas.target import identity_scheme_note

            note = identity_scheme_note(cfg.target, target_identity)
            problems.append(
                f"target identity: the draft was trained on target {cfg.target.get('id')} "
                f"({', '.join(diff)} differ from {target_name}'s {target_identity.get('id')})"
                + (f" [{note.strip()} If it is the same model, pass --ignore-identity.]" if note else "")
            )
    if problems:
        raise EyasError(
            f"checkpoint {ckpt.path} does not fit {target_name}: "
            + "; ".join(problems)
            + ". Export against the target the draft was trained for (--target), or "
            "retrain the draft for this one."
        )
