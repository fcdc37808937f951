"""A draft on disk: ``config.json`` + ``model.safetensors`` (``RUN_DIR/draft``, and the model part of
every training checkpoint), kept apart from the model itself (:mod:`eyas.draft.model`).

The frozen target embedding is not written: it is the target's own, read back from the target when
a draft loads (the target recorded at train time, ``DraftConfig.target_name_or_path``, or the one
the caller names). For the seed's target it was 4.7 GB of fp32 in every checkpoint and draft.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from eyas.errors import EyasError, NonFiniteError
from eyas.fsio import atomic_dir

FROZEN = ("embed_tokens.weight",)  # the target's, never trained: not saved
# what to do about a draft that cannot be read
FIX = (
    "Pass an intact draft: RUN_DIR/draft as `eyas train` wrote it, or train --resume to write it again "
    "from the run's last checkpoint"
)


def check_finite_state(state: dict[str, torch.Tensor], what: str) -> None:
    """Raise :class:`NonFiniteError` naming the first tensor of ``state`` with a NaN or inf: a draft
    with one would serve garbage, so none is written, exported or evaluated."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise NonFiniteError(
                f"{what}: tensor {name!r} has {bad} non-finite values (NaN or inf) of "
                f"{t.numel()}; refusing to use it. Retrain from the last finite "
                "checkpoint (`eyas train ... --resume`, after lowering --lr)"
            )


def trained_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the frozen target tensors, on the CPU, contiguous: what is written."""
    return {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in FROZEN}


def new_draft(cfg, target_dir: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor, seed: int = 0):
    """A fresh draft: random layer, the target's frozen embeddings, lm_head = target rows of the draft vocab."""
    from eyas.draft.model import Eagle3Draft
    from eyas.draft.target_weights import read_target_head

    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        raise EyasError(
            f"draft vocab: d2t has {d2t.numel()} entries and t2d {t2d.numel()}, the "
            f"config expects {cfg.draft_vocab_size} and {cfg.vocab_size}"
        )
    head = read_target_head(target_dir)
    if head["embed"].shape[1] != cfg.hidden_size:
        raise EyasError(
            f"draft hidden_size {cfg.hidden_size} differs from the target's embedding "
            f"width {head['embed'].shape[1]}; EAGLE-3 shares the target's embeddings, "
            "so keep hidden_size at the target's"
        )
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head["embed"].float())
        model.lm_head.weight.copy_(head["lm_head"][ids].float())
        model.d2t.copy_(d2t.long())
        model.t2d.copy_(t2d.bool())
    return model


def load_state(model, state: dict[str, torch.Tensor], what: str, target_dir: str | os.PathLike | None = None) -> None:
    """Load a saved state into ``model``; the frozen embedding, which is not saved, comes from
    ``target_dir`` or the target the draft recorded."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in FROZEN]
    if missing or unexpected:
        raise EyasError(
            f"{what}: missing tensors {missing}, unexpected {unexpected}; it was written by "
            "another version or is damaged"
        )
    from eyas.draft.target_weights import read_target_head

    where = target_dir or model.config.target_name_or_path
    if not where:
        raise EyasError(
            f"{what}: holds no embedding (eyas reads it from the target) and records no target "
            "path; pass the target it was trained for"
        )
    if not Path(where).is_dir():
        raise EyasError(
            f"{what}: its embedding is read from the target it was trained on, {where}, which is "
            "not a directory here; pass that target (--target)"
        )
    embed = read_target_head(where)["embed"]
    if tuple(embed.shape) != tuple(model.embed_tokens.weight.shape):
        raise EyasError(
            f"{what}: the target {where} has an embedding of shape {tuple(embed.shape)}, the draft "
            f"needs {tuple(model.embed_tokens.weight.shape)}; pass the target it was trained for"
        )
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.to(model.embed_tokens.weight.dtype))


def save_draft(model, directory: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json + model.safetensors (without the frozen embedding), written to a temp dir and
    renamed into place. ``state``: a full state dict to write instead of ``model.state_dict()`` (a
    sharded model's, gathered by the caller)."""
    from safetensors.torch import save_file

    state = trained_state(state or model.state_dict())
    check_finite_state(state, f"draft {directory}")
    with atomic_dir(Path(directory)) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    return directory


def load_draft(
    directory: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    target_dir: str | os.PathLike | None = None,
):
    """The draft in ``directory`` (``RUN_DIR/draft``), its embedding from ``target_dir`` or the recorded target."""
    from eyas.draft.model import Eagle3Draft
    from eyas.draft.shapes import check_draft_files
    from eyas.tensorfile import load_tensors

    directory = Path(directory)
    cfg_path, w_path = directory / "config.json", directory / "model.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise EyasError(
            f"draft checkpoint {directory}: needs config.json and model.safetensors "
            "(the RUN_DIR/draft directory written by `eyas train`)"
        )
    cfg, _ = check_draft_files(directory, "draft checkpoint", FIX)  # before the model is made
    model = Eagle3Draft(cfg)
    state = load_tensors(w_path, "draft checkpoint", FIX)
    check_finite_state(state, f"draft checkpoint {w_path}")
    load_state(model, state, f"draft checkpoint {w_path}", target_dir)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)
