"""Tau predicted at training time, from the held-out top-1 agreement per TTT step.

Chain speculation with greedy verification accepts draft token j only if tokens 1..j-1 were
accepted, so with a_j the agreement of TTT step j the expected tokens per target forward for
k draft tokens is ``1 + sum_{i<=k} prod_{j<=i} a_j``. The a_j are measured under teacher forcing
(the data's tokens, the draft's own hidden states), and treated as the probability of step j
given steps < j were right; k is capped at the TTT steps trained, never extrapolated. How close
this comes to the measured tau is recorded in benchmarks/ (benchmarks/gpu_job.md).

A second figure needs neither assumption: :func:`replayed_acceptance` walks the rounds of the
speculative loop over each held-out answer, as ``eyas evaluate --engine replay`` walks the target's
own answers (:mod:`eyas.evaluate.replay`): at every position of an answer, how many chained draft
tokens match the answer's next tokens, each round accepting that chain capped at k and emitting it
plus one token. On self-distilled answers (the target's greedy ones) that is what the loop would
measure on those prompts; on other answers it measures agreement with their text.

Both are also taken over the first ``horizon`` tokens of each answer only, as an evaluation that
stops at that many new tokens sees them. Long self-distilled answers of a small
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


def answer_spans(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every run of True in ``loss_mask`` [B, T] within one document (an answer)
    that has a position before it in its document (the prompt's last token: the first round's anchor)."""
    spans = []
    for b, (mask, docs) in enumerate(zip(loss_mask.tolist(), doc_ids.tolist())):
        start = None
        for i, (m, d) in enumerate(zip(mask + [False], docs + [None])):
            if start is not None and (not m or d != docs[start]):
                if start > 0 and docs[start - 1] == docs[start]:
                    spans.append((b, start, i))
                start = None
            if m and start is None:
                start = i
    return spans


def replayed_acceptance(chains: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor, k_max: int,
                        horizon: int = 0) -> torch.Tensor:
    """[k_max, 1 + k_max]: per k (row k-1) the rounds, then the rounds that accepted draft position
    j, of the loop walked over every answer of the batch (its first ``horizon`` tokens, if set).
    ``chains`` [B, T]: at each position, how many chained draft tokens match the next tokens."""
    from eyas.evaluate.replay import walk

    out = torch.zeros(k_max, 1 + k_max, dtype=torch.float64)
    lengths = chains.tolist()
    for b, start, end in answer_spans(loss_mask, doc_ids):
        n = min(end - start, horizon) if horizon else end - start
        row = lengths[b][start - 1:start - 1 + n]
        for k in range(1, k_max + 1):
            for gained in walk(row, k, n)[1:]:
                out[k - 1, 0] += 1
                out[k - 1, 1:gained] += 1  # positions 1..gained-1 accepted
    return out


def replayed_tau(counts: torch.Tensor) -> list[float | None]:
    """tau per k from :func:`replayed_acceptance`'s counts (summed over batches and ranks)."""
    return [1.0 + float(c[1:].sum() / c[0]) if c[0] > 0 else None for c in counts]

