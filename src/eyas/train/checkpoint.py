"""Training checkpoints: model, optimizer, scheduler, RNG (per rank) and data position, atomically.

A checkpoint is ``RUN_DIR/checkpoints/step-NNNNNNNN/``, built under a temporary name and renamed
when every file is in place, so a crash (even SIGKILL) leaves either a whole checkpoint or none.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import EyasError

STATE = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def tmp_dir_for(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f".tmp-step-{step:08d}"


def begin(run_dir: Path, step: int) -> Path:
    """Create an empty temporary checkpoint directory (rank 0, before the barrier)."""
    tmp = tmp_dir_for(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_rank_rng(tmp: Path, rank: int) -> None:
    torch.save(rng_state(), tmp / f"rng-{rank}.pt")


def finish(run_dir: Path, tmp: Path, step: int, model_state: dict[str, torch.Tensor], optim_state: dict,
           sched_state: dict, trainer_state: dict[str, Any], config: dict[str, Any], keep: int) -> Path:
    """Write the rank-0 files, then rename into place and drop checkpoints beyond ``keep``."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    torch.save({"optimizer": optim_state, "scheduler": sched_state}, tmp / "optimizer.pt")
    (tmp / STATE).write_text(json.dumps(trainer_state, indent=2))  # last: marks completeness
    with open(tmp / STATE) as fh:
        os.fsync(fh.fileno())
    final = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(ckpt: Path, rank: int) -> dict[str, Any]:
    """Everything a rank needs to continue from ``ckpt``."""
    from safetensors.torch import load_file

    state = json.loads((ckpt / STATE).read_text())
    rng_file = ckpt / f"rng-{rank}.pt"
    try:
        opt = torch.load(ckpt / "optimizer.pt", weights_only=False, map_location="cpu")
        return {"trainer": state, "model": load_file(str(ckpt / "model.safetensors")),
                "optimizer": opt["optimizer"], "scheduler": opt["scheduler"],
                "rng": torch.load(rng_file, weights_only=False) if rng_file.is_file() else None}
    except (OSError, RuntimeError, KeyError) as e:
        raise EyasError(f"checkpoint {ckpt} cannot be read ({e}); delete it to resume from an "
                        "earlier one") from e
