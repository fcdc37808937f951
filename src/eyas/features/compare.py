"""`eyas extract --verify STORE --against REFERENCE`: are two stores of the same data the same states?

Backends are proven against each other this way: extract once with ``--backend hf`` and once with
the backend under test, then compare. Every sample must hold the same tokens and loss mask in both
stores; its states are compared token by token, per slot (each aux layer and the final state), by
cosine similarity in fp32. The report names the worst token of every slot, and every sample
(row) that has a token below ``min_cosine``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas.errors import EyasError
from eyas.features.reader import open_store


def compare_stores(
    store: Path,
    reference: Path,
    min_cosine: float = 0.99,
    device: str = "cpu",
    progress: bool = True,
    max_listed: int = 20,
) -> dict[str, Any]:
    """Per-token cosine of ``store``'s states against ``reference``'s; raises when they do not hold
    the same samples. ``ok`` is False when any token of any slot falls below ``min_cosine``."""
    a, b = open_store(store), open_store(reference)
    for key in ("aux_layers", "final_layer", "hidden_size"):
        if a.manifest.get(key) != b.manifest.get(key):
            raise EyasError(
                f"store {store} has {key} {a.manifest.get(key)!r}, reference {reference} "
                f"{b.manifest.get(key)!r}: extract both with the same --target and --layers"
            )
    if set(a.indices.tolist()) != set(b.indices.tolist()):
        raise EyasError(
            f"store {store} holds {len(a)} samples and reference {reference} {len(b)}, not the "
            "same ones: extract both from the same --data"
        )
    slots = [f"aux layer {i}" for i in a.aux_layers] + [f"final (layer {a.final_layer})"]
    worst = [(2.0, -1, -1)] * len(slots)  # (cosine, sample, token) per slot
    below = [0] * len(slots)
    sums = [0.0] * len(slots)
    bad_rows: list[dict[str, Any]] = []
    tokens = 0
    for s in tqdm(a.iter_shard_order(), total=len(a), desc="compare", unit="sample", disable=not progress):
        r = b[s.index]
        if not torch.equal(s.input_ids, r.input_ids) or not torch.equal(s.loss_mask, r.loss_mask):
            raise EyasError(
                f"sample {s.index}: tokens or loss mask differ between {store} and {reference}; "
                "they were prepared from different data or with another tokenizer"
            )
        x = torch.cat([s.aux, s.final[:, None]], dim=1).to(device=device, dtype=torch.float32)
        y = torch.cat([r.aux, r.final[:, None]], dim=1).to(device=device, dtype=torch.float32)
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1, eps=1e-12)  # [T, slots]
        tokens += cos.shape[0]
        mins, where = cos.min(dim=0)
        low = (cos < min_cosine).sum(dim=0)
        total = cos.sum(dim=0)
        row_bad = False
        for j in range(len(slots)):
            m = float(mins[j])
            if m < worst[j][0]:
                worst[j] = (m, s.index, int(where[j]))
            below[j] += int(low[j])
            sums[j] += float(total[j])
            row_bad |= bool(low[j])
        if row_bad:
            bad_rows.append(
                {
                    "sample": s.index,
                    "tokens": int(cos.shape[0]),
                    "min_cosine": float(mins.min()),
                    "tokens_below": int((cos < min_cosine).any(1).sum()),
                }
            )
    bad_rows.sort(key=lambda r: r["min_cosine"])
    return {
        "store": str(store),
        "reference": str(reference),
        "samples": len(a),
        "tokens": tokens,
        "min_cosine_required": min_cosine,
        "ok": not bad_rows,
        "slots": [
            {
                "slot": name,
                "min_cosine": w[0],
                "worst_sample": w[1],
                "worst_token": w[2],
                "mean_cosine": sums[j] / max(tokens, 1),
                "tokens_below": below[j],
            }
            for j, (name, w) in enumerate(zip(slots, worst))
        ],
        "rows_below": len(bad_rows),
        "worst_rows": bad_rows[:max_listed],
    }
