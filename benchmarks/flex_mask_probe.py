"""Where issue 16's wrong compiled attention comes from, narrowed below `eyas train` (CUDA only).

benchmarks/compile_grads.py showed the whole-forward graph wrong only when the TTT block masks are
built inside it. This probe separates the two things that graph does with them:

1. ``tables``: the masks' tile tables (``flex.ttt_block_masks``' tensors) built by a compiled
   function, against eager;
2. ``attention``: flex attention of step 0 in a compiled function that builds the masks itself,
   against the same compiled attention given masks built outside, and against the dense reference.

Prints one line per check and writes --json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from eyas.draft import flex

FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def layout(b: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((b, t), -1, dtype=torch.long)
    for r in range(b):
        at, d = 0, 0
        while at < t - 150:
            n = min(int(torch.randint(20, 700, (1,), generator=g)), t - 100 - at)
            doc[r, at : at + n] = d
            at, d = at + n, d + 1
    return doc.cuda()


def valid_sets(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Dense [.., rows, cols] membership from (num, idx): the order inside the prefix does not matter."""
    out = torch.zeros(*idx.shape, dtype=torch.bool, device=idx.device)
    ar = torch.arange(idx.shape[-1], device=idx.device)
    keep = ar < num[..., None]
    out.scatter_(-1, idx.long(), keep)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    b, t, steps, h, kvh, d = 4, 2048, 3, 9, 3, 64
    doc = layout(b, t, 0)
    raw = flex.ttt_block_masks.__wrapped__ if hasattr(flex.ttt_block_masks, "__wrapped__") else flex.ttt_block_masks
    out: dict = {}

    def tables(doc):
        return [[getattr(m, f) for f in FIELDS] for m in raw(doc, steps)]

    ref = tables(doc)
    got = torch.compile(tables)(doc)
    for j in range(steps):
        for f, x, y in zip(FIELDS, ref[j], got[j]):
            exact = torch.equal(x, y)
            if f.endswith("indices"):
                num = ref[j][FIELDS.index(f.replace("indices", "num_blocks"))]
                num_c = got[j][FIELDS.index(f.replace("indices", "num_blocks"))]
                same = torch.equal(valid_sets(num, x), valid_sets(num_c, y))
            else:
                same = exact
            out[f"tables step {j} {f}"] = {
                "same_sets": same,
                "bitwise": exact,
                "strides": [list(x.stride()), list(y.stride())],
            }
            if not same or not exact:
                print(f"tables step {j} {f}: same sets {same}, bitwise {exact}, strides {x.stride()} vs {y.stride()}")
    print("tables: all compared", flush=True)

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, t, d, device="cuda", generator=g)
    k = torch.randn(b, kvh, steps * t, d, device="cuda", generator=g)
    v = torch.randn(b, kvh, steps * t, d, device="cuda", generator=g)

    def inside(q, k, v, doc):
        m = raw(doc, steps)[0]
        return flex_attention(q, k, v, block_mask=m, enable_gqa=True)

    def outside(q, k, v, m):
        return flex_attention(q, k, v, block_mask=m, enable_gqa=True)

    masks = raw(doc, steps)
    o_in = torch.compile(inside)(q, k, v, doc)
    o_out = torch.compile(outside)(q, k, v, masks[0])
    # dense reference of step 0: same document, not later, among block 0's keys
    same = (doc[:, :, None] == doc[:, None, :]) & torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    kk = k[:, :, :t].repeat_interleave(h // kvh, 1)
    vv = v[:, :, :t].repeat_interleave(h // kvh, 1)
    s = (q @ kk.transpose(-1, -2)) / d**0.5
    dense = torch.softmax(s.masked_fill(~same[:, None], float("-inf")), -1) @ vv
    for name, o in (("masks built inside the graph", o_in), ("masks passed in", o_out)):
        err = ((o - dense).norm() / dense.norm()).item()
        out[f"attention, {name}"] = err
        print(f"attention step 0, {name}: rel err vs dense {err:.2e}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
