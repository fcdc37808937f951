"""Flex attention for the TTT unroll: block-sparse instead of dense [B, heads, T, T] scores.

TTT step j's queries (positions 0..T-1) see the keys ``[k_0 | k_1 | ... | k_j]`` laid side by side
(block n holds step n's keys of every position):

- block 0: same document and not later (``kv <= q``), the packed-document causal mask;
- block n >= 1: only the query's own chain, ``kv - n*T == q``.

The key/value tensors are always ``ttt_steps`` blocks long (blocks past j are zeros and masked
off, so the kernel skips them): every step then has the same shapes and the same mask function
(j enters as a tensor), and one compiled kernel serves the whole unroll instead of one compile
per step (dynamo's recompile limit is 8). On CUDA flex_attention runs through ``torch.compile``
(dynamic shapes off: packs are a fixed token budget); elsewhere it runs eagerly, a slow reference
that the tests compare against the dense path.
"""

from __future__ import annotations

import typing

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from eyas.draft import AttentionKind
from eyas.errors import EyasError

ATTENTION = typing.get_args(AttentionKind)  # --attention's values
TILE = 128  # flex_attention's default block size
_compiled = None
_compiled_mask = None


def resolve(attention: str, device: torch.device, backward: bool = False) -> str:
    """``auto`` -> flex on CUDA (compiled), dense elsewhere (flex's eager path is slow there).

    ``backward``: gradients are needed; torch's flex attention has none on CPU (torch 2.13 raises
    "FlexAttention does not support backward on CPU"), so flex is refused there."""
    if attention not in ATTENTION:  # a plain test: this runs inside the compiled forward
        from eyas.checks import check_choice

        check_choice(attention, AttentionKind, "--attention")  # raises, with the settings' message
    if attention == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if attention == "flex" and backward and device.type != "cuda":
        raise EyasError(
            f"--attention flex on {device.type}: torch's flex attention has no backward "
            f"there (torch {torch.__version__}: 'FlexAttention does not support backward on "
            "CPU'), so it cannot train; use --attention dense (or auto) off CUDA"
        )
    return attention


def _kernel(device: torch.device):
    global _compiled
    if device.type != "cuda":
        return _eager
    if torch.compiler.is_compiling():
        # inside `eyas train --compile`'s graph, which compiles flex itself. A torch.compile made
        # while tracing is traced away: the global would keep the plain function, and every later
        # eager call (held-out evaluation) would run flex unfused, materialising all the scores.
        return flex_attention
    if _compiled is None:  # compile once; every step and batch of the run reuses it
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _eager(*args, **kwargs) -> torch.Tensor:
    """flex_attention without compile: the unfused reference (forward only off CUDA), on purpose."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _mask_mod(doc_ids: torch.Tensor, step: int):
    """TTT step ``step``'s mask over key blocks of length T (doc_ids: [B, T])."""
    t = doc_ids.shape[1]
    # a fill kernel: torch.tensor(step, device=cuda) copies from pageable memory, which waits for
    # the device (7 host syncs per forward)
    last = torch.full((), step, dtype=torch.long, device=doc_ids.device)

    def mask_mod(bi, h, q, kv):
        block = kv // t
        src = kv - block * t
        causal = (block == 0) & (src <= q) & (doc_ids[bi, src] == doc_ids[bi, q])
        chain = (block >= 1) & (block <= last) & (src == q)
        return causal | chain

    return mask_mod


@torch.compiler.disable
def ttt_block_masks(doc_ids: torch.Tensor, steps: int) -> list[BlockMask]:
    """The masks of TTT steps 0..steps-1 over ``steps`` key blocks of length T (doc_ids: [B, T]).

    Never traced into a compiled graph (``torch.compiler.disable``): built inside the whole-forward
    graph of ``eyas train --compile`` and read by flex attention in that same graph, the masks made
    inductor compute other attention than eager on CUDA (torch 2.11: step-0 logits 2% off at
    initialisation, non-finite gradients once attention is sharp; eager and masks built outside
    agree to 1e-6; benchmarks/compile_grads.md). That was the NaN of issue 16. Callers that compile
    build the masks first and pass them in (``Eagle3Draft.forward(block_masks=...)``); a call from
    inside a graph still gets correct masks, at the cost of a graph break."""
    b, t = doc_ids.shape
    mods = [_mask_mod(doc_ids, j) for j in range(steps)]
    if t % TILE == 0:
        return _tiled_block_masks(doc_ids, steps, mods)
    make = create_block_mask
    # compiled, as torch advises (its _compile flag is deprecated in 2.11)
    if doc_ids.is_cuda:
        global _compiled_mask
        if _compiled_mask is None:
            _compiled_mask = torch.compile(create_block_mask)
        make = _compiled_mask
    return [make(m, b, None, t, steps * t, device=doc_ids.device) for m in mods]


def _tiled_block_masks(doc_ids: torch.Tensor, steps: int, mask_mods: list) -> list[BlockMask]:
    """:func:`ttt_block_masks`' tile tables worked out from the documents' layout, without
    evaluating a mask_mod over all [T, steps*T] pairs as ``create_block_mask`` does: compiled, that
    took minutes of a cold `eyas train` start, with or without --compile (benchmarks/compile_time.md),
    and uncompiled its temporaries grow with T^2 * steps.

    Documents are contiguous and in order, padding (-1) last, so a q tile and a kv tile of block 0
    share a document iff the kv tile's last document is the q tile's first; the tile is full iff
    both hold that one document only. Block 0 and the full tiles are the same at every step; step j
    adds block j's diagonal tile of each q tile to step j-1's. Same tables as ``create_block_mask``
    (test)."""
    b, t = doc_ids.shape
    nq, dev = t // TILE, doc_ids.device
    d = torch.where(doc_ids < 0, t, doc_ids).view(b, nq, TILE)  # padding: one more document, last
    lo, hi = d.amin(-1), d.amax(-1)
    a = torch.arange(nq, device=dev)
    earlier = a[None, :, None] > a[None, None, :]  # kv tile c before q tile a
    shares = earlier & (hi[:, None, :] == lo[:, :, None])
    single = lo == hi
    full0 = shares & single[:, None, :] & single[:, :, None]
    partial = torch.zeros(b, nq, steps * nq, dtype=torch.bool, device=dev)
    full = torch.zeros_like(partial)
    partial[:, :, :nq] = (shares & ~full0) | (a[:, None] == a[None, :])
    full[:, :, :nq] = full0

    def tables(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = dense.sum(-1, dtype=torch.int32)
        idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[:, None], idx[:, None]  # one head dimension: the same for every head

    full_tables = tables(full)
    masks = []
    for j, mod in enumerate(mask_mods):
        if j:
            partial[:, a, j * nq + a] = True  # tables() copies, so the earlier steps keep theirs
        masks.append(
            BlockMask.from_kv_blocks(
                *tables(partial), *full_tables, BLOCK_SIZE=TILE, mask_mod=mod, seq_lengths=(t, steps * t)
            )
        )
    return masks


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: BlockMask, steps: int, scale: float
) -> torch.Tensor:
    """Attention of step ``len(keys)-1``: q [B, heads, T, d], keys/values per step [B, kv_heads, T, d]
    (GQA handled by the kernel, no expanded copies). Returns [B, heads, T, d]."""
    if q.is_cuda and q.shape[-1] < 16:
        raise EyasError(
            f"--attention flex: head_dim {q.shape[-1]} is below 16, which flex attention's "
            "Triton kernel does not support; use --attention dense for this draft"
        )
    pad = [torch.zeros_like(keys[0])] * (steps - len(keys))
    k = torch.cat([*keys, *pad], dim=2)
    v = torch.cat([*values, *pad], dim=2)
    return _kernel(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
