"""Non-finite training steps: never applied, counted, and the run stopped once they repeat.

A step whose loss or gradient norm is not finite must not reach the weights. On fused AdamW (every
CUDA run with ``--optimizer adamw``) the skip happens on the device: the optimizer's ``found_inf``
flag, the one ``torch.amp.GradScaler`` uses, makes its kernel leave weights, moments and step count
untouched, so a step still never waits for the device. Other optimizers (the CPU's unfused AdamW,
Muon) are checked on the host before they step.

The host learns the verdict with the step's other numbers (one step late, see the trainer's
``flush``): :meth:`NonFiniteGuard.record` counts the skip and raises :class:`NonFiniteError` after
``limit`` skips in a row. Nothing has been saved from a skipped step, so the last checkpoint is the
last finite state, and ``--resume`` starts there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eyas.errors import EyasError, EyasWarning, NonFiniteError


def _optimizers(optim: Any) -> list[torch.optim.Optimizer]:
    return list(getattr(optim, "optims", [optim]))


class NonFiniteGuard:
    """Wraps ``optim.step()``: skipped when the step's loss or gradient norm is not finite."""

    def __init__(self, optim: Any, limit: int):
        if limit < 1:
            raise EyasError(
                f"--max-nonfinite-steps {limit}: must be at least 1 (skipped steps in a row before the run stops)"
            )
        self.optim, self.limit = optim, limit
        self.optims = _optimizers(optim)
        self.on_device = all(isinstance(o, torch.optim.AdamW) and o.defaults.get("fused") for o in self.optims)
        self.skipped = 0  # in this process's run (a resumed run counts afresh)
        self.in_a_row: list[dict[str, Any]] = []

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Step the optimizer unless ``loss`` or ``grad_norm`` is not finite (both reduced over
        ranks, so every rank decides alike); returns the verdict as a device bool."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.on_device:
            found_inf = (~finite).float()
            for o in self.optims:
                o.found_inf = found_inf
            self.optim.step()
        elif bool(finite):
            self.optim.step()
        return finite

    def record(self, finite: bool, step: int, describe: dict[str, Any]) -> None:
        """Host side, once step ``step``'s numbers are read: count a skip. ``describe``: what the
        error names (samples, per-TTT-step losses, grad norm)."""
        if finite:
            self.in_a_row = []
            return
        self.skipped += 1
        self.in_a_row.append({"step": step, **describe})
        import warnings

        warnings.warn(
            f"step {step}: non-finite {_what(describe)}; the optimizer step was skipped "
            f"({len(self.in_a_row)} in a row, the run stops at {self.limit})",
            category=EyasWarning,
            stacklevel=2,
        )

    def stop_if_repeated(self) -> None:
        """Raise :class:`NonFiniteError` once ``limit`` steps in a row were skipped."""
        if len(self.in_a_row) >= self.limit:
            first = self.in_a_row[0]
            steps = ", ".join(str(r["step"]) for r in self.in_a_row)
            raise NonFiniteError(
                f"training stopped: {len(self.in_a_row)} steps in a row ({steps}) had a non-finite "
                f"{_what(first)}. The first, step {first['step']}: {_detail(first)}. Nothing from these "
                "steps was applied or saved: the latest checkpoint holds the last finite state and "
                "`--resume` starts there. Lower --lr, raise --warmup or --clip, or check the samples "
                "named (`eyas extract --verify` for their stored states)"
            )


def _what(d: dict[str, Any]) -> str:
    losses = d.get("step_loss") or []
    first = next((j for j, x in enumerate(losses) if not math.isfinite(x)), None)
    if first is not None:
        return f"loss (TTT step {first} first)"
    return "gradient norm (the loss was finite)"


def _detail(d: dict[str, Any]) -> str:
    losses = ", ".join(f"{x:.4g}" for x in d.get("step_loss") or [])
    samples = d.get("samples") or []
    shown = ", ".join(str(s) for s in samples[:32]) + (f", ... ({len(samples)} in all)" if len(samples) > 32 else "")
    return f"per-TTT-step losses [{losses}], gradient norm {d.get('grad_norm')}, dataset samples [{shown}]"
