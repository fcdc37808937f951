"""Writing an export directory atomically: temp dir beside the target, then a rename."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.fsio import atomic_dir


def write_model_dir(
    out: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
    inputs: dict[str, Any] | None = None,
) -> Path:
    """``config.json`` + ``model.safetensors`` (+ small text files) into ``out`` in one rename."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise EyasError(
                f"--out {out}: exists and is not empty; pass --overwrite to replace it or choose a new directory"
            )
        if not is_export(out):
            raise EyasError(
                f"--out {out} exists and is not an eyas export (no config.json that `eyas export` "
                "wrote); --overwrite replaces only an earlier export, never another folder. "
                "Choose another --out, or move that folder away yourself (nothing was written)"
            )
    with atomic_dir(out, inputs) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out


def is_export(folder: Path) -> bool:
    """``folder`` holds what :func:`write_model_dir` wrote for ``eyas export`` (its config records it)."""
    try:
        info = json.loads((Path(folder) / "config.json").read_text()).get("eyas")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(info, dict) and "format" in info


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return str(tensors["fc.weight"].dtype).replace("torch.", "")


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast floating tensors to ``dtype`` (integer/bool buffers such as d2t/t2d keep theirs)."""
    out = {}
    for k, v in tensors.items():
        v = v.detach().cpu()
        out[k] = v.to(dtype).contiguous() if dtype is not None and v.is_floating_point() else v.contiguous()
    return out
