"""Where `eyas train --compile`'s start-up time goes, piece by piece, on a cold or warm cache.

    python benchmarks/compile_time.py [--ttt-steps 7] [--tokens 2048] [--packs 4]

Builds a SmolLM2-135M-sized draft (random weights: compile time does not depend on them) and a
random packed batch, then times each compiled piece's first forward+backward call in the order
the trainer meets them: the flex block mask, the flex kernel, the step regions, a whole TTT unroll
and the fused loss's chunk. Prints one line per piece as it finishes (so a cut-off run still says
how far it got) and a JSON record at the end.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eyas.draft import flex
from eyas.draft.fused_loss import chunk_fn
from eyas.draft.model import DraftConfig, Eagle3Draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--packs", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = DraftConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=32000,
        aux_layer_ids=[2, 15, 27],
        target_hidden_size=576,
    )
    m = Eagle3Draft(cfg).to(dev)
    b, t = a.packs, a.tokens
    g = torch.Generator().manual_seed(0)
    doc = torch.sort(torch.randint(0, 8, (b, t), generator=g), dim=1).values.to(dev)
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        d = doc[r].cpu()
        start = 0
        for i in range(1, t + 1):
            if i == t or d[i] != d[start]:
                pos[r, start:i] = torch.arange(i - start)
                start = i
    pos = pos.to(dev)
    x = torch.randint(0, 49152, (b, t), generator=g).to(dev)
    aux = torch.randn(b, t, 3 * 576, generator=g).to(dev, torch.bfloat16)
    rec: dict[str, float] = {}
    t0 = time.perf_counter()

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        rec[name] = time.perf_counter() - t0
        print(f"{rec[name]:8.1f} s  {name}", flush=True)

    masks = flex.ttt_block_masks(doc, a.ttt_steps)
    mark("block masks (compiled create_block_mask), all steps")
    q = torch.randn(b, 9, t, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(b, 3, t, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    o = flex.ttt_attention(q, kv, kv, masks[1], a.ttt_steps, 0.125)
    mark("flex kernel forward")
    o.float().sum().backward()
    mark("flex kernel backward")
    m.compile_regions()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = m(aux, x, pos, doc, a.ttt_steps, attention="flex", return_normed=True)
    mark("TTT unroll forward with compiled regions")
    sum(o.float().sum() for o in outs).backward()
    mark("TTT unroll backward")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs = m(aux, x, pos, doc, a.ttt_steps, attention="flex", return_normed=True)
    sum(o.float().sum() for o in outs).backward()
    mark("second unroll forward+backward (no compile expected)")
    terms = chunk_fn(True)
    w = m.lm_head.weight.detach().to(torch.bfloat16)
    tz = torch.randn(5000, 32000, device=dev, dtype=torch.bfloat16)
    lse, top = torch.logsumexp(tz.float(), -1), tz.argmax(-1)
    for n in (4096, 903):  # a full chunk and a shorter last one (dynamic)
        rows = torch.randint(0, 5000, (n,), device=dev)
        terms(torch.randn(n, 576, device=dev, dtype=torch.bfloat16), w, tz, lse, top, rows, True)
    mark("fused-loss chunk (compiled, two lengths)")
    print(json.dumps(rec))
    if a.json:
        open(a.json, "w").write(
            json.dumps({"seconds_since_start": rec, "args": vars(a), "torch": torch.__version__}, indent=2)
        )


if __name__ == "__main__":
    main()
