"""The fused TTT loss with lm_head sharded over the vocab (``eyas train --fused-loss --parallel fsdp2``).

Under FSDP2 with the fused loss, lm_head is its own FSDP unit that never runs a forward (the draft
returns its normed hidden, ``return_normed``), so it is never all-gathered: each rank holds rows
``[off, off + n)`` of it, the DTensor's ``to_local()`` (FSDP2 shards dim 0 as ``torch.chunk`` does:
``ceil(V / world)`` rows per rank, the last ranks fewer, possibly none). Each rank has its own
micro-batch, and a row's loss needs every vocab shard, so every rank scores every rank's rows
against its own shard, one source rank at a time (a broadcast of that rank's rows: memory per rank
stays one rank's rows and one [chunk, V / world] block, whatever the world size):

- the target: its normed final rows are broadcast the same way and each rank keeps its vocab
  columns of the target logits for all ranks' rows ([world * rows, V / world]: as many numbers as
  the single-process [rows, V]); their logsumexp and argmax come from per-shard (max, sum of exp,
  argmax) combined across ranks, one all-gather of [world * rows, 3];
- per TTT step, the forward gathers per-shard (max, sum of exp, <p, z>, argmax) of the draft
  logits (one all-gather) and combines them into each row's logsumexp, cross entropy and argmax
  (the first index of the maximum, as ``argmax`` of the whole row gives);
- the backward recomputes the logits (the gradient of a rank's rows needs that rank's gradient
  scale, known only in the backward: saving per-rank lm_head gradients would cost a whole
  lm_head per rank). d loss / d hidden of rank r's rows is the sum over shards: reduced to rank r.
  d loss / d shard is the data-parallel mean over ranks (FSDP2's reduce-scatter convention),
  computed here whole: FSDP2 never sees this unit's gradient unsharded.

Every rank must call it the same number of times with the same TTT steps (collectives in the
forward and the backward): :func:`sharded_ttt_loss` scores every step, empty ones too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eyas.draft.loss import StepStats, TargetHead

_STATS = 4  # per row and shard: max, sum of exp(z - max), <p, z>, argmax


def shard_rows(weight) -> tuple[int, int]:
    """(offset, rows) of this rank's shard of a dim-0 sharded DTensor (torch.chunk's split)."""
    mesh = weight.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    v = weight.shape[0]
    per = -(-v // world)
    off = min(rank * per, v)
    n = min(per, v - off)
    if weight.to_local().shape[0] != n:
        raise RuntimeError(
            f"lm_head's local shard has {weight.to_local().shape[0]} rows, expected {n} "
            f"(rows {off}.. of {v} over {world} ranks)"
        )
    return off, n


@dataclass
class _Comm:
    group: object
    rank: int
    world: int
    off: int  # this rank's first vocab row
    chunk: int
    dtype: torch.dtype | None
    compiled: bool


def _broadcasts(x: torch.Tensor, n_max: int, comm: _Comm):
    """Yield (r, rank r's ``x`` padded with zero rows to ``n_max``) for every rank r in turn."""
    own = x.new_zeros((n_max, *x.shape[1:]))
    own[: x.shape[0]] = x
    for r in range(comm.world):
        buf = own if r == comm.rank else torch.empty_like(own)
        dist.broadcast(buf, src=dist.get_global_rank(comm.group, r), group=comm.group)
        yield r, buf


def _all_gather(x: torch.Tensor, comm: _Comm) -> torch.Tensor:
    """[world, *x.shape]: every rank's ``x``."""
    out = x.new_empty((comm.world * x.shape[0], *x.shape[1:]))  # concatenated: what gloo takes
    dist.all_gather_into_tensor(out, x.contiguous(), group=comm.group)
    return out.view(comm.world, *x.shape)


def _local_stats(z: torch.Tensor, off: int, p: torch.Tensor | None) -> torch.Tensor:
    """[rows, 4] float64: this shard's max, sum of exp(z - max), <p, z> and global argmax."""
    if z.shape[-1] == 0:  # an empty shard (more ranks than rows to give)
        out = torch.zeros(z.shape[0], _STATS, dtype=torch.float64, device=z.device)
        out[:, 0] = -torch.inf
        return out
    m = z.amax(-1, keepdim=True)
    s = torch.exp(z - m).sum(-1)
    pz = (p * z).sum(-1) if p is not None else torch.zeros_like(s)
    return torch.stack([m.squeeze(-1).double(), s.double(), pz.double(), (z.argmax(-1) + off).double()], -1)


def _combine(local: torch.Tensor, comm: _Comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp [N] fp32, sum of <p, z> [N] fp64, argmax [N]) of rows whose per-shard stats are
    ``local`` [N, 4] on each rank."""
    st = _all_gather(local, comm)  # [world, N, 4]
    m = st[..., 0]
    top_m = m.amax(0)
    lse = top_m + torch.log((st[..., 1] * torch.exp(m - top_m)).sum(0))
    top = torch.where(m == top_m, st[..., 3], torch.inf).amin(0).long()  # first index of the max
    return lse.float(), st[..., 2].sum(0), top


def _draft_stats(hc, w, tz, t_lse, rows, off: int) -> torch.Tensor:
    z = (hc @ w.T).float()
    p = torch.exp(tz[rows].float() - t_lse[rows, None])
    return _local_stats(z, off, p)


def _draft_grad(hc, w, tz, t_lse, rows, lse, scale) -> torch.Tensor:
    """d CE / d logits of one chunk on this shard, times each row's gradient scale."""
    z = (hc @ w.T).float()
    p = torch.exp(tz[rows].float() - t_lse[rows, None])
    return ((torch.exp(z - lse[:, None]) - p) * scale[:, None]).to(hc.dtype)


_compiled: dict[str, object] = {}


def _fn(name: str, compiled: bool):
    f = {"stats": _draft_stats, "grad": _draft_grad}[name]
    if not compiled:
        return f
    if name not in _compiled:
        _compiled[name] = torch.compile(f, dynamic=True)
    return _compiled[name]


class _ShardedSoftCE(torch.autograd.Function):
    """(sum over this rank's rows of CE(softmax(h W^T), p), top-1 agreements), W sharded over the
    vocab; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        h: torch.Tensor,
        w_local: torch.Tensor,
        target: tuple[torch.Tensor, ...],
        rows: torch.Tensor,
        valid: torch.Tensor,
        n_max: int,
        comm: _Comm,
    ):
        tz, t_lse, t_top = target
        dtype = comm.dtype or h.dtype
        w = w_local.detach().to(dtype)
        stats = _fn("stats", comm.compiled)
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            local = []
            for r, hr in _broadcasts(h.detach().to(dtype), n_max, comm):
                rr = rows[r * n_max : (r + 1) * n_max]
                local += [
                    stats(hr[s : s + comm.chunk], w, tz, t_lse, rr[s : s + comm.chunk], comm.off)
                    for s in range(0, n_max, comm.chunk)
                ]
            lse, pz, top = _combine(torch.cat(local), comm)
            mine = slice(comm.rank * n_max, comm.rank * n_max + h.shape[0])
            loss = (lse[mine].double() - pz[mine]).sum().float()
            correct = (top[mine] == t_top[rows[mine]]).sum().float()
        ctx.save_for_backward(h, w_local, lse, rows, valid)
        ctx.target, ctx.n_max, ctx.comm = target, n_max, comm
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor):
        h, w_local, lse, rows, valid = ctx.saved_tensors
        tz, t_lse, _ = ctx.target
        n_max, comm = ctx.n_max, ctx.comm
        dtype = comm.dtype or h.dtype
        w = w_local.detach().to(dtype)
        grad_fn = _fn("grad", comm.compiled)
        # each row's scale: its rank's gradient of that rank's loss (0 on padding rows)
        scale = _all_gather(grad_loss.reshape(1).float(), comm).repeat_interleave(n_max) * valid
        grad_w = torch.zeros(w_local.shape, dtype=torch.float32, device=w_local.device)
        grad_h = None
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            for r, hr in _broadcasts(h.detach().to(dtype), n_max, comm):
                part = torch.zeros((n_max, h.shape[1]), dtype=torch.float32, device=h.device)
                base = r * n_max
                for s in range(0, n_max, comm.chunk):
                    e = min(s + comm.chunk, n_max)
                    hc = hr[s:e]
                    g = grad_fn(
                        hc,
                        w,
                        tz,
                        t_lse,
                        rows[base + s : base + e],
                        lse[base + s : base + e],
                        scale[base + s : base + e],
                    )
                    part[s:e] = (g @ w).float()
                    grad_w += (g.T @ hc).float()
                dist.reduce(part, dst=dist.get_global_rank(comm.group, r), group=comm.group)
                if r == comm.rank:
                    grad_h = part[: h.shape[0]].to(h.dtype)
        # the data-parallel mean over ranks, as FSDP2's reduce-scatter gives the other parameters
        return grad_h, (grad_w / comm.world).to(w_local.dtype), None, None, None, None, None


@torch.no_grad()
def _target_rows(
    head: TargetHead, final: torch.Tensor, flat: torch.Tensor, n_max: int, comm: _Comm, n_local: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """((this shard's target logits [world * n_max, n_local], logsumexp [world * n_max],
    argmax [world * n_max]) for every rank's target rows, row index (in that stacking) per flat
    position of this rank [B*T] or -1)."""
    b, t = final.shape[:2]
    row_of = torch.full((b * t,), -1, dtype=torch.long, device=final.device)
    row_of[flat] = torch.arange(flat.numel(), device=final.device) + comm.rank * n_max
    w = head.weight[comm.off : comm.off + n_local]
    with torch.autocast(final.device.type, enabled=False):
        x = head.normed(final.reshape(b * t, -1)[flat])
        tz = torch.cat([F.linear(xr, w.to(xr.dtype)) for _, xr in _broadcasts(x, n_max, comm)])
        local = torch.cat(
            [_local_stats(tz[s : s + comm.chunk].float(), comm.off, None) for s in range(0, tz.shape[0], comm.chunk)]
        )
        lse, _, top = _combine(local, comm)
    return (tz, lse, top), row_of


def sharded_ttt_loss(
    normed: list[torch.Tensor],
    weight,
    head: TargetHead,
    final: torch.Tensor,
    loss_mask: torch.Tensor,
    scored,
    step_decay: float,
    chunk: int,
    dtype: torch.dtype | None,
    compiled: bool,
) -> tuple[torch.Tensor, list[StepStats]]:
    """:func:`eyas.draft.fused_loss.fused_ttt_loss` with ``weight`` a dim-0 sharded DTensor (the
    FSDP2 lm_head): the same value, stats and gradients as the single-process fused loss over the
    same rows, each rank holding only its shard. Collective: every rank calls it."""
    mesh = weight.device_mesh
    off, n_local = shard_rows(weight)
    comm = _Comm(mesh.get_group(), mesh.get_local_rank(), mesh.size(), off, chunk, dtype, compiled)
    device = final.device
    steps = len(normed)
    # every rank's row counts (target rows, then each step's): the padding of each exchange
    counts = torch.tensor([scored.flat.numel()] + [bi.numel() for bi, _ in scored.steps], device=device)
    counts = _all_gather(counts, comm).cpu()  # [world, 1 + steps]
    n_max = [max(1, int(c)) for c in counts.amax(0)]  # at least one row: no empty collectives
    target, row_of = _target_rows(head, final, scored.flat, n_max[0], comm, n_local)
    t = loss_mask.shape[1]
    w_local = weight.to_local()
    total = torch.zeros((), dtype=torch.float32, device=device)
    stats = []
    for j in range(steps):  # every step, empty ones too: the same collectives on every rank
        bi, ii = scored.steps[j]
        nm = n_max[1 + j]
        # position i of step j predicts x[i+2+j] (in the loss mask): the target's row at i+1+j
        own = torch.zeros(nm, dtype=torch.long, device=device)
        own[: bi.numel()] = row_of[bi * t + ii + 1 + j]
        rows = _all_gather(own, comm).flatten()  # padding rows read row 0 and count 0
        valid = (torch.arange(nm)[None, :] < counts[:, 1 + j, None]).flatten().float().to(device)
        loss_sum, correct = _ShardedSoftCE.apply(normed[j][bi, ii], w_local, target, rows, valid, nm, comm)
        count = torch.full((), float(bi.numel()), device=device)
        total = total + (step_decay**j) * loss_sum / count.clamp_min(1.0)
        stats.append(StepStats(loss_sum.detach(), correct.detach(), count))
    return total, stats
