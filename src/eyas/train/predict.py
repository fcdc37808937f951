"""Tau predicted at training time, from the held-out top-1 agreement per TTT step.

Chain speculation with greedy verification accepts draft token j only if tokens 1..j-1 were
accepted, so with a_j the agreement of TTT step j the expected tokens per target forward for
k draft tokens is ``1 + sum_{i<=k} prod_{j<=i} a_j``. The a_j are measured under teacher forcing
(the data's tokens, the draft's own hidden states), and treated as the probability of step j
given steps < j were right; k is capped at the TTT steps trained, never extrapolated. How close
this comes to the measured tau is recorded in benchmarks/ (benchmarks/gpu_job.md).

The held-out agreement is also taken over the first ``horizon`` tokens of each answer only, as an
evaluation that stops at that many new tokens sees them. Long self-distilled answers of a small
target loop (79% of the tokens of SmolLM2's regenerated ShareGPT repeat an earlier 8-token context,
33% of its 256-token MT-bench answers), and a loop is easy to predict, so agreement over whole
answers overstates what a capped evaluation finds.
"""

from __future__ import annotations

from typing import Sequence

import torch

PREDICTION_FILE = "prediction.json"  # written beside the draft's weights by `eyas train`


def predicted_tau(acc: Sequence[float]) -> list[float]:
    """Predicted chain tau for k = 1..len(acc) (one value per TTT step's agreement ``acc``)."""
    out, run, total = [], 1.0, 1.0
    for a in acc:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"agreement {a!r} per TTT step must lie in [0, 1]")
        run *= a
        total += run
        out.append(total)
    return out


def first_answer_tokens(loss_mask: torch.Tensor, horizon: int) -> torch.Tensor:
    """``loss_mask`` [B, T] kept only at the first ``horizon`` positions of each run of True (an answer)."""
    idx = torch.arange(loss_mask.shape[-1]).expand_as(loss_mask)
    prev = torch.zeros_like(loss_mask)
    prev[..., 1:] = loss_mask[..., :-1]
    starts = torch.where(loss_mask & ~prev, idx, torch.full_like(idx, -1))
    offset = idx - torch.cummax(starts, dim=-1).values
    return loss_mask & (offset < horizon)
