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
    (tmp / f"rng-{rank}.json").write_text(json.dumps(rng_to_json(rng_state())))


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """The RNG states as plain JSON (no pickle): byte tensors and the MT19937 key as int lists."""
    name, key, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss = state["python"]
    out = {
        "torch": state["torch"].tolist(),
        "numpy": [name, np.asarray(key).tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }
    if "cuda" in state:
        out["cuda"] = [t.tolist() for t in state["cuda"]]
    return out


def rng_from_json(data: dict[str, Any]) -> dict[str, Any]:
    name, key, pos, has_gauss, cached = data["numpy"]
    version, internal, gauss = data["python"]
    state = {
        "torch": torch.tensor(data["torch"], dtype=torch.uint8),
        "numpy": (name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached),
        "python": (version, tuple(internal), gauss),
    }
    if "cuda" in data:
        state["cuda"] = [torch.tensor(t, dtype=torch.uint8) for t in data["cuda"]]
    return state


def finish(
    run_dir: Path,
    tmp: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict,
    sched_state: dict,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    keep: int,
) -> Path:
    """Write the rank-0 files, then rename into place and drop checkpoints beyond ``keep``."""
    from safetensors.torch import save_file

    from eyas.draft.io import trained_state

    save_file(trained_state(model_state), str(tmp / "model.safetensors"))  # no frozen target embedding
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


class Unreadable(Exception):
    """A checkpoint file that cannot be read back (cut off, corrupt, or refused by weights_only)."""


def load(ckpt: Path, rank: int) -> dict[str, Any]:
    """Everything a rank needs to continue from ``ckpt``. Nothing is unpickled: tensors come from
    safetensors, the rest from JSON, and ``optimizer.pt`` loads with ``torch.load(weights_only=True)``,
    which refuses any pickled callable. Raises Unreadable naming the file that failed."""
    from safetensors.torch import load_file

    def read(name: str, fn):
        try:
            return fn(ckpt / name)
        except Exception as e:  # noqa: BLE001 - any failure to read a file makes the checkpoint unusable
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise Unreadable(f"{ckpt / name}: {type(e).__name__}: {first}") from e

    state = read(STATE, lambda p: json.loads(p.read_text()))
    config = read("config.json", lambda p: json.loads(p.read_text()))
    if not isinstance(state, dict):
        raise Unreadable(f"{ckpt / STATE}: not a JSON object")
    for key in ("step", "run"):
        if key not in state:
            raise Unreadable(f"{ckpt / STATE}: has no {key!r}")
    check_own_record(ckpt, state)
    read("model.safetensors", lambda p: _check_fits(config, p))  # before the tensors are read
    model = read("model.safetensors", lambda p: load_file(str(p)))
    opt = read("optimizer.pt", lambda p: torch.load(p, weights_only=True, map_location="cpu"))
    # None for a rank the checkpoint's run did not have
    rng = read(f"rng-{rank}.json", lambda p: rng_from_json(json.loads(p.read_text())) if p.is_file() else None)
    if not isinstance(opt, dict) or "optimizer" not in opt or "scheduler" not in opt:
        raise Unreadable(f"{ckpt / 'optimizer.pt'}: not an eyas optimizer file")
    last = opt["scheduler"].get("last_epoch") if isinstance(opt["scheduler"], dict) else None
    if isinstance(last, int) and last != state["step"]:
        raise Unreadable(
            f"{ckpt / 'optimizer.pt'}: its schedule is at step {last}, {STATE} says "
            f"{state['step']}; the files are not of one checkpoint"
        )
    return {
        "trainer": state,
        "config": config,
        "model": model,
        "optimizer": opt["optimizer"],
        "scheduler": opt["scheduler"],
        "rng": rng,
        "path": ckpt,
    }


def step_of(ckpt: Path) -> int | None:
    """The step a checkpoint folder's name says (``step-00000004`` -> 4)."""
    try:
        return int(Path(ckpt).name.split("-")[1])
    except (IndexError, ValueError):
        return None


def check_own_record(ckpt: Path, state: dict[str, Any]) -> None:
    """A checkpoint's trainer_state.json against the checkpoint itself: its step an integer, the
    step the folder is named for (an edited or misplaced file would otherwise set where training
    resumes, and what the summary says, from the wrong weights); raises Unreadable."""
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise Unreadable(f"{ckpt / STATE}: step {step!r} is not a step number")
    named = step_of(ckpt)
    if named is not None and step != named:
        raise Unreadable(
            f"{ckpt / STATE}: says step {step}, but it is the checkpoint of step {named} "
            f"({ckpt.name}); the file was edited or comes from another checkpoint"
        )
    for key in ("tokens_seen", "world_size"):
        v = state.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise Unreadable(f"{ckpt / STATE}: {key} {v!r} is not a count")


def _check_fits(config: Any, weights: Path) -> None:
    from eyas.draft.model import DraftConfig
    from eyas.draft.shapes import pre_release_problem, shape_problems
    from eyas.tensorfile import tensor_shapes

    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    cfg = DraftConfig.from_dict(config)
    shapes = tensor_shapes(weights, "checkpoint weights", "")
    old = pre_release_problem(shapes)
    if old:
        raise ValueError(old)
    problems = shape_problems(cfg, shapes)
    if problems:
        raise ValueError("config.json does not fit it: " + "; ".join(problems[:4]))


def check_resume_step(resumed: dict[str, Any], total: int, flag: str = "--max-steps") -> None:
    """Refuse to resume a checkpoint past the run's planned ``total`` steps: its weights are of a
    later step than the run would end at, so the draft, the summary and the metrics would disagree
    (a finished 6-step run resumed with --max-steps 4 wrote the step-6 draft as a 4-step run)."""
    step = int(resumed["trainer"]["step"])
    if step > total:
        path = Path(resumed["path"])
        raise EyasError(
            f"cannot resume {path}: it is at step {step}, past the {total} steps this run plans "
            f"({flag} or the epochs); a run cannot be shortened after the fact. Resume with "
            f"{flag} >= {step}, use the draft this run already wrote ({path.parents[1] / 'draft'}), "
            "or start a new --out"
        )


def no_checkpoint_note(run_dir: Path) -> str:
    """What ``--resume`` says when ``run_dir`` holds no checkpoint to resume: training starts at step 0."""
    return (
        f"warning: --resume: {run_dir} holds no checkpoint (checkpoints/step-*), so training starts at "
        "step 0; check --out if you meant to continue a run"
    )


def load_latest(run_dir: Path, rank: int, log=None) -> dict[str, Any]:
    """The newest checkpoint of ``run_dir`` that reads back whole. Each newer one that does not is
    named (``log``) and, on rank 0, moved aside to ``checkpoints/.broken-step-N`` so that pruning
    never counts it; none readable is an EyasError listing why."""
    import sys

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    failed = []
    for path in reversed(checkpoint_dirs(run_dir)):
        try:
            got = load(path, rank)
        except Unreadable as e:
            failed.append(str(e))
            aside = path.with_name(f".broken-{path.name}")
            if rank == 0:
                try:
                    os.replace(path, aside)
                except OSError:
                    aside = path
            log(f"warning: checkpoint {path.name} is unreadable ({e}); moved aside to {aside}, trying the previous one")
            continue
        if failed:
            log(f"resuming from {path} (the newest complete checkpoint)")
        return got
    raise EyasError(
        f"no checkpoint in {Path(run_dir) / 'checkpoints'} can be read: "
        + "; ".join(failed)
        + ". Start again with a new --out (or without --resume after deleting the run's "
        "checkpoints)"
    )
