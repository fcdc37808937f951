"""Verification of a chain of draft tokens against the target: greedy and rejection sampling.

Sampling follows Leviathan et al. / Chen et al.: draft token d_i ~ q_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the replacement is drawn from
norm(max(p_i - q_i, 0)); if all k are accepted a bonus token is drawn from p_k. The emitted
tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """``target_logits`` [k+1, V] at the verified positions, ``draft_tokens`` [k].

    Returns (number of accepted draft tokens n, the target's token at position n).
    """
    target_tokens = target_logits.argmax(dim=-1)
    k = draft_tokens.numel()
    match = (target_tokens[:k] == draft_tokens).to(torch.int64)
    # one copy to the host (one wait for the device) for both numbers
    host = torch.cat([match.cumprod(0).sum().view(1), target_tokens]).tolist()
    return host[0], host[1 + host[0]]


def verify_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Rejection sampling. ``target_probs`` [k+1, V], ``draft_probs`` [k, V] (both over the
    target vocab; the draft's mass is zero outside its vocab), ``draft_tokens`` [k] drawn from
    ``draft_probs``. Returns (n accepted, next token)."""
    k = draft_tokens.numel()
    for i in range(k):
        d = int(draft_tokens[i])
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator))
        # q > 0 whenever d was drawn from q; u < p/q written without the division.
        if u * q < p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        total = residual.sum()
        if total <= 0:  # p == q exactly: rejection has probability 0; guard against rounding
            residual, total = target_probs[i], target_probs[i].sum()
        return i, int(torch.multinomial(residual / total, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def probs_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at ``temperature`` in float32 (the comparison p/q needs more than bf16)."""
    return torch.softmax(logits.float() / temperature, dim=-1)
