"""On a CUDA machine: `eyas train` with its defaults compiles the TTT forward and uses the fused loss,
and trains to the losses of the eager, unfused run (bf16 autocast both).

    PYTHONPATH=src python scripts/check_cuda_defaults.py [OUT_JSON]

A tiny random Llama (tests/tiny.py) and random prepared data: needs torch, transformers, pyarrow,
safetensors, no network and no model download. Exit 1 when the defaults are not the fast ones or
the losses differ by more than 3%.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny  # noqa: E402
from eyas.data.dataset import write_prepared  # noqa: E402
from eyas.target import resolve_target  # noqa: E402
from eyas.train.trainer import TrainConfig, run as train  # noqa: E402


def data(path: Path, target, n: int = 96, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    vocab = target.config()["vocab_size"]
    ids = [rng.integers(4, vocab, int(rng.integers(12, 56))).tolist() for _ in range(n)]
    masks = [[0] * (len(x) // 3) + [1] * (len(x) - len(x) // 3) for x in ids]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(rng.permutation(vocab)[:96])] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(96)
    return write_prepared(path, ids, masks, [f"rand:{i}" for i in range(n)], target, d2t, t2d)


def main() -> int:
    assert torch.cuda.is_available(), "run this on a CUDA machine"
    work = Path(tempfile.mkdtemp(prefix="eyas-cuda-defaults-"))
    target = resolve_target(tiny.make_target(work / "target", "llama"))
    prepared = data(work / "data", target)
    base = dict(
        target=str(target.path),
        data=str(prepared),
        features="online",
        layers=[1, 4, 6],
        ttt_steps=3,
        tokens_per_batch=128,
        batch_size=2,
        max_steps=40,
        warmup=2,
        lr=1e-3,
        save_every=0,
        eval_every=0,
        eval_batches=2,
        heldout=0.1,
        progress=False,
    )
    runs = {}
    for name, kw in (("defaults", {}), ("eager", {"compile": False, "fused_loss": False})):
        out = work / name
        t = time.perf_counter()
        train(TrainConfig(out=str(out), **base, **kw))
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads((out / "train_config.json").read_text())
        runs[name] = {
            "compile": cfg["compile"],
            "fused_loss": cfg["fused_loss"],
            "seconds": time.perf_counter() - t,
            "loss": [r["loss"] for r in recs if r.get("split") == "train"],
        }
    a, b = runs["defaults"]["loss"], runs["eager"]["loss"]
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    ok = runs["defaults"]["compile"] is True and runs["defaults"]["fused_loss"] is True and worst < 0.03
    result = {
        "ok": ok,
        "worst_relative_loss_difference": worst,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": len(a),
        **{k: {kk: vv for kk, vv in v.items() if kk != "loss"} for k, v in runs.items()},
        "loss_first_last": {k: [v["loss"][0], v["loss"][-1]] for k, v in runs.items()},
    }
    print(json.dumps(result, indent=2))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
