"""The hand-over format between the engine and eyas: packed chunk files, written atomically.

A chunk holds several whole samples: ``indices`` [n], ``offsets`` [n+1] into the packed token
axis, ``input_ids`` [total] (what the model actually saw, so eyas can check attribution) and
``states`` [total, L, H] with L = aux layers + the final state, in the layer order of the job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX = "chunk-"


def write_chunk(
    out_dir: str | os.PathLike,
    name: str,
    samples: list[tuple[int, torch.Tensor, torch.Tensor]],
    meta: dict | None = None,
) -> Path:
    """Write ``[(index, input_ids [T], states [T,L,H]), ...]`` as one chunk (temp name + rename)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(ids.numel()) for _, ids, _ in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "indices": torch.tensor([i for i, _, _ in samples], dtype=torch.int64),
        "offsets": offsets,
        "input_ids": torch.cat([ids.to(torch.int64).reshape(-1) for _, ids, _ in samples]),
        "states": torch.cat([st.contiguous() for _, _, st in samples]),
    }
    path = out / f"{PREFIX}{name}.safetensors"
    tmp = out / f".{PREFIX}{name}.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"eyas": json.dumps(meta or {})})
    os.replace(tmp, path)
    return path


def list_chunks(out_dir: str | os.PathLike) -> list[Path]:
    """Finished chunk files in ``out_dir`` (temp files are never listed)."""
    d = Path(out_dir)
    return sorted(d.glob(f"{PREFIX}*.safetensors")) if d.is_dir() else []


def read_chunk(path: str | os.PathLike) -> tuple[dict, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """Return ``(meta, [(index, input_ids [T], states [T,L,H]), ...])``."""
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("eyas", "{}"))
        t = {k: f.get_tensor(k) for k in ("indices", "offsets", "input_ids", "states")}
    off = t["offsets"].tolist()
    out = []
    for j, index in enumerate(t["indices"].tolist()):
        a, b = off[j], off[j + 1]
        out.append((int(index), t["input_ids"][a:b], t["states"][a:b]))
    return meta, out
