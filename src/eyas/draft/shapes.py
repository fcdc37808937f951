"""A draft's config.json against its weights, before either is used: the tensor shapes the config
makes (the model built on the meta device: no memory, and the same code that builds the real one)
compared with the shapes the safetensors header holds. A config that says ``intermediate_size``
2e9 over weights 1,536 wide would otherwise be exported as it is, or allocate terabytes when
loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.errors import EyasError

FROZEN = ("embed_tokens.weight",)  # the target's: not in drafts written by this eyas

# the config fields that size each tensor, named in a mismatch
_SIZED_BY = (
    ("midlayer.mlp.", "intermediate_size, hidden_size"),
    ("midlayer.self_attn.", "num_attention_heads, num_key_value_heads, head_dim, hidden_size"),
    ("lm_head.", "draft_vocab_size, hidden_size"),
    ("d2t", "draft_vocab_size"),
    ("t2d", "vocab_size"),
    ("embed_tokens.", "vocab_size, hidden_size"),
    ("fc.", "aux_layer_ids, target_hidden_size, hidden_size"),
    ("fc_norm.", "target_hidden_size"),
    ("input_norm.", "aux_layer_ids, target_hidden_size"),
)


def expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the draft ``cfg`` (a DraftConfig) describes."""
    import torch

    from eyas.draft.model import Eagle3Draft

    with torch.device("meta"):
        model = Eagle3Draft(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def shape_problems(cfg: Any, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What differs between the tensors ``cfg`` makes and ``shapes`` (those of a file)."""
    want = expected_shapes(cfg)
    problems = []
    for name, shape in want.items():
        got = shapes.get(name)
        if got is None:
            if name not in FROZEN:
                problems.append(f"{name} is missing")
        elif tuple(got) != shape:
            fields = next((f for prefix, f in _SIZED_BY if name.startswith(prefix)), "")
            values = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in fields.split(", ") if f)
            problems.append(
                f"{name} is {list(got)} in the weights, the config makes it {list(shape)}"
                + (f" ({values})" if values else "")
            )
    extra = sorted(set(shapes) - set(want))
    if extra:
        problems.append(f"the weights hold tensors the config does not make: {extra[:5]}")
    return problems


def pre_release_problem(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why weights holding the target's embedding are refused: only a pre-release eyas saved it, in
    every draft and checkpoint, so this refuses its older layouts too (RNG pickles, no recorded
    optimizer, configs without later fields)."""
    held = [k for k in FROZEN if k in shapes]
    if held:
        return (
            f"it holds the target's embedding ({held[0]}), which only a pre-release eyas saved; train the "
            "draft again with this eyas"
        )
    return None


def check_draft_files(directory: str | Path, what: str, fix: str) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """(DraftConfig, tensor shapes) of the draft or checkpoint in ``directory``, after checking
    config.json's fields, the safetensors header, and the one against the other; nothing is loaded."""
    import json

    from eyas.draft.model import DraftConfig
    from eyas.tensorfile import tensor_shapes

    directory = Path(directory)
    cfg_path, w_path = directory / "config.json", directory / "model.safetensors"
    try:
        data = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise EyasError(f"{what} {cfg_path}: unreadable ({e}). {fix}") from None
    if not isinstance(data, dict):
        raise EyasError(f"{what} {cfg_path}: not a JSON object. {fix}")
    try:
        cfg = DraftConfig.from_dict(data)
    except TypeError as e:  # a required field missing
        raise EyasError(f"{what} {cfg_path}: {e}. {fix}") from None
    shapes = tensor_shapes(w_path, what, fix)
    old = pre_release_problem(shapes)
    if old:
        raise EyasError(f"{what} {w_path}: {old}")
    problems = shape_problems(cfg, shapes)
    if problems:
        raise EyasError(
            f"{what} {directory}: config.json does not fit model.safetensors: " + "; ".join(problems[:6]) + f". {fix}"
        )
    return cfg, shapes
