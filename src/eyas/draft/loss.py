"""The TTT loss: the draft against the target's next-token distribution over the draft vocab.

The target distribution is computed on the fly from the stored final (pre-norm) state with the
target's own final norm and lm_head rows of the draft vocab; logits are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class TargetHead(nn.Module):
    """softmax over the draft vocab of ``lm_head(final_norm(h_N))``: frozen, no gradients."""

    def __init__(self, norm_weight: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor, eps: float):
        super().__init__()
        ids = torch.arange(d2t.numel()) + d2t.long().cpu()
        self.register_buffer("norm_weight", norm_weight.detach().clone())
        self.register_buffer("weight", lm_head.detach()[ids].clone())  # [draft_vocab, H]
        self.eps = eps

    @classmethod
    def from_target(cls, target_dir, d2t: torch.Tensor, eps: float) -> "TargetHead":
        from eyas.draft.target_weights import read_target_head

        head = read_target_head(target_dir)
        return cls(head["norm"], head["lm_head"], d2t, eps)

    @torch.no_grad()
    def normed(self, final: torch.Tensor) -> torch.Tensor:
        """The target's final norm of final states [.., H], in the head's dtype: what its lm_head takes."""
        dtype = self.norm_weight.dtype
        x = final.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * x.to(dtype)  # as the target's RMSNorm does

    @torch.no_grad()
    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """Target logits over the draft vocab for final states [.., H], in the head's dtype (what
        its matmul gives: converting them to fp32 adds no information)."""
        x = self.normed(final)
        return F.linear(x, self.weight.to(x.dtype))

    @torch.no_grad()
    def forward(self, final: torch.Tensor) -> torch.Tensor:
        """Target logits over the draft vocab, in fp32, for final states [.., H]."""
        return self.logits(final).float()


@dataclass
class StepStats:
    """Per TTT step sums over one batch (kept as tensors so ranks can all-reduce them)."""

    loss_sum: torch.Tensor  # sum of per-token cross entropies
    correct: torch.Tensor  # top-1 agreements with the target
    count: torch.Tensor  # positions counted


def soft_cross_entropy(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Cross entropy of softmax(z) against the distribution p, per position, in fp32.

    logsumexp(z) - <p, z> never materialises log_softmax(z). The dot is an elementwise product
    and a sum: as a batched [1,V]x[V,1] matmul it was 40% of an H200 training step (cuBLAS runs
    it as thousands of tiny gemv's; benchmarks/train_bench.md). ``eyas train --compile`` fuses
    the whole function into one reduction.
    """
    z = z.float()
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)


def step_valid(loss_mask: torch.Tensor, doc_ids: torch.Tensor, j: int) -> torch.Tensor | None:
    """[B, T-2-j]: the positions i TTT step j scores, those whose predicted token x[i+2+j] is inside
    the pack, in the same document and in the loss mask; None when T <= 2+j."""
    n = loss_mask.shape[1] - 2 - j
    if n <= 0:
        return None
    return loss_mask[:, 2 + j :].bool() & (doc_ids[:, 2 + j :] == doc_ids[:, :n])


def reduce_ttt_steps(
    num_steps: int,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    step_decay: float,
    score: Callable[[int, int, torch.Tensor], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, list[StepStats]]:
    """The TTT loss's bookkeeping, shared by :func:`ttt_loss` and the fused loss: per step j,
    ``score(j, n, valid)`` gives (loss_sum, correct, count) over the positions it scores
    (:func:`step_valid`, [B, n]); the result is the decay-weighted sum of the per-step mean losses."""
    total = torch.zeros((), dtype=torch.float32, device=loss_mask.device)
    stats = []
    for j in range(num_steps):
        valid = step_valid(loss_mask, doc_ids, j)
        if valid is None:
            zero = total.new_zeros(())
            stats.append(StepStats(zero, zero, zero))
            continue
        loss_sum, correct, count = score(j, valid.shape[1], valid)
        total = total + (step_decay**j) * loss_sum / count.clamp_min(1.0)
        stats.append(StepStats(loss_sum.detach(), correct.detach(), count.detach()))
    return total, stats


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    step_decay: float,
    ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = soft_cross_entropy,
) -> tuple[torch.Tensor, list[StepStats]]:
    """Weighted sum over steps of the masked mean cross entropy against the target distribution.

    step_logits[j][b,i] predicts x[i+2+j]; the target's distribution for that token comes from its
    logits at i+1+j. A position counts when x[i+2+j] is in the same document and in the loss mask.
    target_logits: [B,T,draft_vocab] (no grad); loss_mask, doc_ids: [B,T].
    The target's softmax is taken once and each step reads it through a slice (a view, no copy);
    ``ce`` is :func:`soft_cross_entropy` or a compiled version of it.
    """
    p_all = torch.softmax(target_logits.float(), dim=-1)
    tgt_top = target_logits.argmax(-1)

    def score(j: int, n: int, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, w = step_logits[j][:, :n], valid.float()
        loss_sum = (ce(logits, p_all[:, 1 + j : 1 + j + n]) * w).sum()
        correct = ((logits.argmax(-1) == tgt_top[:, 1 + j : 1 + j + n]).float() * w).sum()
        return loss_sum, correct, w.sum()

    return reduce_ttt_steps(len(step_logits), loss_mask, doc_ids, step_decay, score)
