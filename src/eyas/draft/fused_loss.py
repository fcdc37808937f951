"""The TTT loss fused with the draft's lm_head, chunked over the scored positions.

:func:`eyas.draft.loss.ttt_loss` takes the draft's logits: per TTT step one [tokens, draft_vocab]
tensor kept for backward, plus the target's logits and softmax over the whole pack, all in fp32.
On the H200 those passes are the largest cost of a compiled step (benchmarks/train_bench.md).
Here only the positions the loss counts are scored (the loss mask drops prompt tokens: about half
of a chat dataset's tokens):

- the target's logits, their logsumexp and argmax are computed once per batch, for the positions
  whose next token is in the loss mask; every TTT step reads its rows from them (step j's target
  rows are a subset of step 0's);
- per step, chunk by chunk, the lm_head matmul, the target's distribution, the cross entropy and its
  gradient run together: no fp32 [tokens, vocab] tensor outlives its chunk, and the gradients
  w.r.t. the draft's normed hidden and lm_head come out of the same pass.

Same value and gradients as :func:`ttt_loss` (test).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.draft.loss import StepStats, TargetHead, reduce_ttt_steps, step_valid


def chunk_terms(
    hc: torch.Tensor,
    w: torch.Tensor,
    tz: torch.Tensor,
    t_lse: torch.Tensor,
    t_top: torch.Tensor,
    rows: torch.Tensor,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (sum of CEs, top-1 agreements, d CE / d logits in ``hc``'s dtype or None).

    ``tz``/``t_lse``/``t_top``: the batch's target logits, logsumexp and argmax; ``rows``: this
    chunk's rows of them. Everything between the two matmul families of the backward lives here,
    so that ``--compile`` turns the fp32 [chunk, draft_vocab] passes (logits, target softmax,
    logsumexp, their difference, the gather of the target rows) into a few fused kernels
    (:func:`chunk_fn`)."""
    z = (hc @ w.T).float()
    p = torch.exp(tz[rows].float() - t_lse[rows, None])
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    loss = (lse.squeeze(-1) - (p * z).sum(-1)).sum()
    correct = (z.argmax(-1) == t_top[rows]).sum().float()
    g = (torch.exp(z - lse) - p).to(hc.dtype) if need_grad else None
    return loss, correct, g


_compiled_chunk = None


def chunk_fn(compiled: bool):
    """:func:`chunk_terms`, compiled once per process when ``compiled`` (dynamic: chunks and
    batches score different numbers of positions)."""
    global _compiled_chunk
    if not compiled:
        return chunk_terms
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(chunk_terms, dynamic=True)
    return _compiled_chunk


class _FusedSoftCE(torch.autograd.Function):
    """sum_rows CE(softmax(h W^T), softmax(tz[rows])) and the number of top-1 agreements."""

    @staticmethod
    def forward(
        ctx,
        h: torch.Tensor,
        weight: torch.Tensor,
        target: tuple[torch.Tensor, ...],
        rows: torch.Tensor,
        chunk: int,
        dtype: torch.dtype | None,
        terms,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = dtype or h.dtype
        w = weight.to(dtype)  # the matmul dtype autocast gives the unfused lm_head
        need_grad = any(ctx.needs_input_grad[:2])  # not for held-out evaluation under no_grad
        grad_h = torch.zeros_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            for s in range(0, h.shape[0], chunk):
                # detached: the same compiled graph for every call (requires_grad is guarded on)
                hc = h[s : s + chunk].detach().to(dtype)
                loss_c, correct_c, g = terms(hc, w.detach(), *target, rows[s : s + chunk], need_grad)
                loss += loss_c
                correct += correct_c
                if g is None:
                    continue
                grad_h[s : s + chunk] = (g @ w).to(h.dtype)
                grad_w += (g.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_loss.to(grad_h.dtype),
            (grad_w * grad_loss).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _valid(loss_mask: torch.Tensor, doc_ids: torch.Tensor, j: int) -> torch.Tensor:
    """:func:`step_valid` padded to [B, T] (False past T-2-j)."""
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid = step_valid(loss_mask, doc_ids, j)
    if valid is not None:
        out[:, : valid.shape[1]] = valid
    return out


@dataclass
class Scored:
    """Where the loss looks: the flat positions whose next token is in the loss mask (the target's
    rows, [R]) and per TTT step the (batch, position) indices that step scores."""

    flat: torch.Tensor
    steps: list[tuple[torch.Tensor, torch.Tensor]]

    def to(self, device: torch.device) -> "Scored":
        """On ``device``; from the host without waiting for it: one page-locked, non-blocking copy
        of all the indices, split again on the device."""
        if self.flat.device == device:
            return self
        parts = [self.flat] + [x for pair in self.steps for x in pair]
        packed = torch.cat(parts)
        if device.type == "cuda" and packed.device.type == "cpu":
            packed = packed.pin_memory()
        moved = packed.to(device, non_blocking=True).split([x.numel() for x in parts])
        return Scored(moved[0], list(zip(moved[1::2], moved[2::2])))


@torch.no_grad()
def positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor, steps: int) -> Scored:
    """The positions the loss scores, found with one ``nonzero`` for all steps. Called on the
    batch's host tensors (the trainer does, ``Batch.layout``) it never waits for the device; on
    device tensors ``nonzero`` waits for everything queued before it."""
    need = torch.zeros_like(loss_mask, dtype=torch.bool)
    need[:, :-1] = loss_mask[:, 1:].bool()
    stacked = torch.stack([need] + [_valid(loss_mask, doc_ids, j) for j in range(steps)])
    nz = stacked.nonzero()
    counts = torch.bincount(nz[:, 0], minlength=steps + 1).tolist()
    parts = nz.split(counts)
    t = loss_mask.shape[1]
    return Scored(parts[0][:, 1] * t + parts[0][:, 2], [(q[:, 1], q[:, 2]) for q in parts[1:]])


def target_stats(tz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp in fp32, argmax) of target logits [R, V]: one fused reduction when compiled."""
    z = tz.float()
    return torch.logsumexp(z, dim=-1), z.argmax(-1)


_compiled_stats = None


@torch.no_grad()
def target_rows(
    head: TargetHead, final: torch.Tensor, flat: torch.Tensor, chunk: int, compiled: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """((logits, logsumexp, argmax) of the target at the flat positions ``flat`` (those whose next
    token is in the loss mask), row index per flat position [B*T] or -1). Logits stay in the head's
    matmul dtype (bf16 on the GPU: half the bytes of fp32, and all the precision the matmul gave).
    ``compiled``: logsumexp and argmax in one compiled pass over the logits (eager, they took
    several fp32 passes over [R, draft_vocab]; benchmarks/train_bench.md); eager, chunk by
    chunk so that no fp32 copy of all the logits exists."""
    global _compiled_stats
    b, t = final.shape[:2]
    row_of = torch.full((b * t,), -1, dtype=torch.long, device=final.device)
    row_of[flat] = torch.arange(flat.numel(), device=final.device)
    with torch.autocast(final.device.type, enabled=False):
        tz = head.logits(final.reshape(b * t, -1)[flat])
        if not tz.shape[0]:
            return (
                tz,
                tz.new_zeros(0, dtype=torch.float32),
                torch.zeros(0, dtype=torch.long, device=tz.device),
            ), row_of
        if compiled:
            if _compiled_stats is None:
                _compiled_stats = torch.compile(target_stats, dynamic=True)
            lse, top = _compiled_stats(tz)
        else:
            parts = [target_stats(tz[s : s + chunk]) for s in range(0, tz.shape[0], chunk)]
            lse, top = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    return (tz, lse, top), row_of


def _is_sharded(weight: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def fused_ttt_loss(
    normed: list[torch.Tensor],
    lm_head_weight: torch.Tensor,
    head: TargetHead,
    final: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    step_decay: float,
    chunk: int = 4096,
    dtype: torch.dtype | None = None,
    compiled: bool = False,
    scored: Scored | None = None,
) -> tuple[torch.Tensor, list[StepStats]]:
    """:func:`eyas.draft.loss.ttt_loss` from the draft's normed hidden per TTT step
    (``Eagle3Draft.forward(..., return_normed=True)``) and the target's final states [B,T,H].
    ``dtype``: the lm_head matmuls' dtype (bf16 under bf16 autocast; default: the hidden's).
    ``compiled``: each chunk's elementwise work through torch.compile (``eyas train --compile``).
    ``scored``: :func:`positions` of this batch, when already known (from its host tensors);
    otherwise found here from ``loss_mask`` and ``doc_ids``. ``lm_head_weight`` a DTensor sharded
    over the vocab (``eyas train --fused-loss --parallel fsdp2``): :mod:`eyas.draft.sharded_loss`,
    collective, the same value and gradients with each rank holding only its rows of lm_head."""
    scored = (scored or positions(loss_mask, doc_ids, len(normed))).to(final.device)
    if _is_sharded(lm_head_weight):  # FSDP2's lm_head, rows sharded over the ranks (collective)
        from eyas.draft.sharded_loss import sharded_ttt_loss

        return sharded_ttt_loss(
            normed, lm_head_weight, head, final, loss_mask, scored, step_decay, chunk, dtype, compiled
        )
    terms = chunk_fn(compiled)
    target, row_of = target_rows(head, final, scored.flat, chunk, compiled)
    t = loss_mask.shape[1]

    def score(j: int, n: int, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bi, ii = scored.steps[j]
        # position i of step j predicts x[i+2+j] (in the loss mask): the target's row at i+1+j
        rows = row_of[bi * t + ii + 1 + j]
        loss_sum, correct = _FusedSoftCE.apply(normed[j][bi, ii], lm_head_weight, target, rows, chunk, dtype, terms)
        return loss_sum, correct, valid.sum().float()

    return reduce_ttt_steps(len(normed), loss_mask, doc_ids, step_decay, score)
