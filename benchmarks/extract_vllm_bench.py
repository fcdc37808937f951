"""Extraction tokens/s of the vLLM backends beside the HF backend: same data slice, same run.

    .venv/bin/python benchmarks/extract_vllm_bench.py --data PREPARED [--max-samples 64]
        [--model-dtype fp32] [--json out.json]

For each backend the same first N samples of a prepared dataset go through `extract`
(store dtype bf16) and the store is verified. Reported per backend:
  wall_tok_s    tokens / wall seconds of the whole `extract` call (HF: model load included;
                vLLM: engine process start, model load and store writing included)
  steady_tok_s  HF: eyas's own count from the first batch to the last shard (load excluded);
                vLLM: tokens / seconds of the engine's prefill loop (after start-up), from the
                engine log, with chunk writing in the worker included
vLLM backends run from .venvs/vllm-0.32.0 (vllm) and .venvs/vllm-0.16.0 (vllm-hooks) when present.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from eyas.data.dataset import open_prepared, write_prepared
from eyas.extract.config import ExtractConfig
from eyas.extract.run import extract
from eyas.features.reader import open_store
from eyas.features.verify import verify_store
from eyas.extract.vllm_backend import engine_timings
from eyas.target import resolve_target

ROOT = Path(__file__).resolve().parents[1]
RUNS = [("hf", None), ("vllm", "0.32.0"), ("vllm-hooks", "0.16.0")]


def subset(ds, target, n: int, out: Path) -> Path:
    rows = [ds[i] for i in range(min(n, len(ds)))]
    d2t, t2d = ds.draft_vocab()
    return write_prepared(
        out,
        [r.input_ids.tolist() for r in rows],
        [r.loss_mask.astype(np.int8).tolist() for r in rows],
        [r.source_id for r in rows],
        target,
        d2t,
        t2d,
    )


def min_cosine(a_dir: Path, b_dir: Path) -> float:
    """Smallest per-token cosine between two stores of the same data (all slots)."""
    import torch

    a, b = open_store(a_dir), open_store(b_dir)
    worst = 1.0
    for i in range(len(b)):
        x, y = a[i], b[i]
        assert torch.equal(x.input_ids, y.input_ids) and x.aux.shape == y.aux.shape
        sx = torch.cat([x.aux, x.final[:, None]], 1).float()
        sy = torch.cat([y.aux, y.final[:, None]], 1).float()
        worst = min(worst, torch.nn.functional.cosine_similarity(sx, sy, dim=-1).min().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-samples", type=int, default=64)
    ap.add_argument("--model-dtype", default="fp32")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tgt = resolve_target(args.target)
    work = Path(args.work or tempfile.mkdtemp(prefix="eyas-vbench-"))
    shutil.rmtree(work / "data", ignore_errors=True)
    data = subset(open_prepared(args.data, tgt), tgt, args.max_samples, work / "data")
    ds = open_prepared(data, tgt)
    results = []
    for backend, version in RUNS:
        py = None
        if version:
            py = ROOT / ".venvs" / f"vllm-{version}" / "bin" / "python"
            if not py.is_file():
                print(f"skip {backend}: {py} absent")
                continue
        store = work / f"store-{backend}"
        shutil.rmtree(store, ignore_errors=True)
        t0 = time.perf_counter()
        s = extract(
            ExtractConfig(
                target=tgt.spec,
                data=data,
                out=store,
                backend=backend,
                dtype="bf16",
                device="cpu",
                batch_tokens=args.batch_tokens,
                model_dtype=args.model_dtype,
                vllm_python=str(py) if py else None,
                progress=False,
            )
        )
        wall = time.perf_counter() - t0
        problems = verify_store(store)
        assert not problems, problems
        assert len(open_store(store)) == len(ds)
        row = {
            "backend": backend,
            "vllm": version,
            "samples": len(ds),
            "tokens": s["tokens"],
            "loadavg_1m_after": round(os.getloadavg()[0], 1),
            "wall_s": round(wall, 2),
            "wall_tok_s": round(s["tokens"] / wall, 1),
        }
        if backend == "hf":
            row.update(steady_s=round(s["seconds"], 2), steady_tok_s=round(s["tokens_per_s"], 1))
        else:
            (eng,) = engine_timings(store)
            row.update(
                startup_s=eng["startup_s"], steady_s=eng["loop_s"], steady_tok_s=round(eng["tokens"] / eng["loop_s"], 1)
            )
        if backend != "hf" and (work / "store-hf").is_dir():
            row["min_cos_vs_hf"] = round(min_cosine(store, work / "store-hf"), 5)
        print(json.dumps(row), flush=True)
        results.append(row)
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPU cores, no GPU",
        "command": "benchmarks/extract_vllm_bench.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "target": args.target,
        "model_dtype": args.model_dtype,
        "store_dtype": "bf16",
        "results": results,
    }
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
