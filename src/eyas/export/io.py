"""Writing an export directory atomically: temp dir beside the target, then a rename."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError


def write_model_dir(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                    extra_files: dict[str, str] | None = None, overwrite: bool = False) -> Path:
    """``config.json`` + ``model.safetensors`` (+ small text files) into ``out`` in one rename."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise EyasError(f"--out {out}: exists and is not empty; pass --overwrite to replace it or "
                        "choose a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return str(tensors["fc.weight"].dtype).replace("torch.", "")
