"""The draft's optimizer and LR schedule: AdamW, or Muon for the hidden matrices + AdamW for the rest.

Muon (``torch.optim.Muon``, torch >= 2.9) orthogonalises the update of 2-D weight matrices; the
usual split keeps vectors (norm weights) and the output head on AdamW. With
``adjust_lr_fn="match_rms_adamw"`` its update has AdamW's RMS, so one ``--lr`` serves both groups.

AdamW alone is a plain ``torch.optim.AdamW`` (checkpoints as before); Muon + AdamW are driven as
one :class:`Optimizers` (step, zero_grad, a state dict ``{"optimizers": [...]}``), each with its
own scheduler over one :class:`Schedule` (:class:`Schedules`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from eyas.errors import EyasError

# 2-D weights kept on AdamW: the output head (Muon's convention; also the embedding, frozen here)
ADAMW_MATRICES = ("lm_head",)


class Schedule:
    """The LR multiplier of each optimizer step: linear warmup to 1 over ``warmup`` steps, then a decay
    to ``min_ratio`` that reaches it at the last step (``total - 1``): cosine, linear, or wsd (held at
    the peak, then linear over the last ``decay_fraction`` of the steps).

    A callable object, not a function: LambdaLR checkpoints its attributes, so a plan made by
    :meth:`plan` (``--budget``) is resumed with the scheduler's state. Until then ``decay_from`` may
    be past every step (the schedule holds at the peak after warmup)."""

    def __init__(
        self,
        kind: str,
        warmup: int,
        total: int,
        min_ratio: float,
        decay_fraction: float = 0.2,
        decay_from: int | None = None,
    ):
        self.kind, self.warmup, self.total, self.min_ratio = kind, warmup, total, min_ratio
        self.decay_fraction = decay_fraction
        self.decay_from = warmup if decay_from is None else decay_from
        self.top = 1.0  # the multiplier the decay starts from
        self.anchored = False  # a re-plan restarted the decay from the step it was made at
        self.planned_at: int | None = None  # the steps --budget planned the run at, if it did
        self.replanned_at: int | None = None

    def decay_start(self) -> int:
        if self.kind == "wsd" and not self.anchored:
            last = self.total - 1
            # at least one step of decay, so that the last step is at the floor even in a short run
            decay = max(1, round(self.decay_fraction * max(0, last - self.warmup)))
            return max(self.decay_from, last - decay)
        return self.decay_from

    def plan(self, total: int, at_step: int) -> None:
        """End the schedule at ``total`` steps, decaying from ``at_step`` on (the steps before it have run)."""
        self.total, self.decay_from, self.planned_at = total, max(self.warmup, at_step), at_step

    def replan(self, total: int, at_step: int) -> None:
        """Move the end to ``total`` after ``at_step`` steps have run: a decay under way goes on from
        the rate it has reached, so the LR does not jump."""
        if at_step > self.decay_start():
            self.top, self.decay_from, self.anchored = self(at_step), at_step, True
        self.total, self.replanned_at = total, at_step

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        start = self.decay_start()
        if step < start:
            return self.top
        frac = min(1.0, (step - start) / max(1, self.total - 1 - start))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if self.kind == "cosine" else 1 - frac
        return self.min_ratio + (self.top - self.min_ratio) * shape


class Optimizers:
    """Optimizers stepped, zeroed and checkpointed together."""

    def __init__(self, optims: list[torch.optim.Optimizer]):
        self.optims = optims

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optims for g in o.param_groups]

    def step(self) -> None:
        for o in self.optims:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optims:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optims]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizers")
        if saved is None or len(saved) != len(self.optims):
            raise EyasError(
                f"the checkpoint holds {'one optimizer' if saved is None else f'{len(saved)} optimizers'}, "
                f"this run builds {len(self.optims)}: resume with the same --optimizer"
            )
        for o, s in zip(self.optims, saved):
            o.load_state_dict(s)


class Schedules:
    """One LambdaLR per optimizer, stepped and checkpointed together."""

    def __init__(self, optims: Optimizers, fn: Callable[[int], float]):
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, fn) for o in optims.optims]

    def step(self) -> None:
        for s in self.scheds:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.scheds]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s, st in zip(self.scheds, state["schedulers"]):
            s.load_state_dict(st)


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon params, AdamW params) among the trainable ones, in ``model.parameters()`` order."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and not any(h in name for h in ADAMW_MATRICES)
        (muon if matrix else adamw).append(p)
    return muon, adamw


def schedule(optim: "torch.optim.Optimizer | Optimizers", fn: Callable[[int], float]):
    """The LR schedule ``fn`` (a multiplier per step) on ``optim``."""
    if isinstance(optim, Optimizers):
        return Schedules(optim, fn)
    return torch.optim.lr_scheduler.LambdaLR(optim, fn)


def reapply(sched, fn: Callable[[int], float]) -> None:
    """Set each parameter group's LR to ``fn`` at ``sched``'s current step (a LambdaLR or
    :class:`Schedules`). Resuming restores the rates the checkpoint's run set, which after a change of
    the schedule (a resumed run of another length) are the old schedule's until the next step."""
    for s in getattr(sched, "scheds", [sched]):
        for g, base in zip(s.optimizer.param_groups, s.base_lrs):
            g["lr"] = base * fn(s.last_epoch)


def build(
    model: nn.Module, kind: str, lr: float, betas: tuple[float, float], weight_decay: float, fused: bool, sharded: bool
) -> "torch.optim.Optimizer | Optimizers":
    """The run's optimizers over ``model``'s trainable parameters (after any FSDP2/DDP wrap)."""
    if kind == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
    if not hasattr(torch.optim, "Muon"):
        raise EyasError(f"--optimizer muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}")
    if sharded:
        raise EyasError(
            "--optimizer muon is not supported with --parallel fsdp2 yet (Muon orthogonalises "
            "whole matrices, FSDP2 shards them); use --parallel ddp or --optimizer adamw"
        )
    muon, adamw = muon_split(model)
    optims: list[torch.optim.Optimizer] = [
        torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    ]
    if adamw:
        optims.append(torch.optim.AdamW(adamw, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused))
    return Optimizers(optims)
