"""End-to-end `eyas extract` throughput (HF backend) beside the naive approach, same run, same data.

    python benchmarks/extract_bench.py --data PREPARED --store-dir /dev/shm/eyas-bench [--max-samples N]

Measures on the same length-sorted batches:
  eyas      extract(): forward + hooks -> pinned async D2H -> shard files on disk; tokens/s
            from the first batch to the last shard renamed into place (model load excluded,
            a short warm-up run in the same process first)
  forward   the base-model forward with hooks alone (no copy, no write): the GPU ceiling
  naive     output_hidden_states=True, then .to("cpu") of the 4 states (no writing at all)
Tokens are real (unpadded) tokens. Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eyas.data.dataset import open_prepared, write_prepared
from eyas.features.capture import HiddenStateCapture
from eyas.features.layers import resolve_layers
from eyas.extract.config import ExtractConfig
from eyas.extract.run import plan_batches, resolve_device, extract
from eyas.features.reader import open_store
from eyas.features.verify import verify_store
from eyas.target import resolve_target


def subset(ds, target, n: int | None, out: Path) -> Path:
    """The first ``n`` samples as a prepared dataset for ``target`` (same tokens)."""
    n = len(ds) if n is None else min(n, len(ds))
    rows = [ds[i] for i in range(n)]
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


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batches(ds, batch_tokens: int, max_tokens: int | None = None):
    """The extract plan's batches as right-padded id tensors, up to ``max_tokens`` real tokens."""
    done = 0
    for b in plan_batches(ds.lengths, batch_tokens):
        rows = [ds[i].input_ids for i in b]
        T = max(len(r) for r in rows)
        ids = np.zeros((len(rows), T), dtype=np.int64)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = r
        real = sum(len(r) for r in rows)
        yield torch.from_numpy(ids), real
        done += real
        if max_tokens is not None and done >= max_tokens:
            return


def time_forward(model, aux, ds, batch_tokens, device, max_tokens=None) -> dict:
    cap = HiddenStateCapture(model, aux)
    data = [(ids.to(device), real) for ids, real in batches(ds, batch_tokens, max_tokens)]
    sync(device)
    t = time.perf_counter()
    for ids, _ in data:
        cap.capture_into(ids)
    sync(device)
    dt_ = time.perf_counter() - t
    cap.remove()
    tok = sum(r for _, r in data)
    return {"tokens": tok, "seconds": dt_, "tokens_per_s": tok / dt_}


@torch.inference_mode()
def time_naive(model, aux, ds, batch_tokens, device, max_tokens=None) -> dict:
    base = model.get_decoder()
    data = [(ids.to(device), real) for ids, real in batches(ds, batch_tokens, max_tokens)]
    sync(device)
    t = time.perf_counter()
    for ids, _ in data:
        hs = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        _ = [hs[k].to("cpu") for k in aux] + [hs[-1].to("cpu")]
    sync(device)
    dt_ = time.perf_counter() - t
    tok = sum(r for _, r in data)
    return {"tokens": tok, "seconds": dt_, "tokens_per_s": tok / dt_}


@torch.inference_mode()
def parity(model, aux, ds, store: Path, device: str, picks=(0, 1, -1)) -> dict:
    """Stored states vs a lone output_hidden_states forward (bf16): worst per-token cosine."""
    r = open_store(store)
    base = model.get_decoder()
    worst = 1.0
    for p in picks:
        i = int(r.indices[p])
        ids = torch.from_numpy(ds[i].input_ids)[None].to(device)
        hs = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        s = r[i]
        for slot, k in enumerate(aux):
            c = torch.nn.functional.cosine_similarity(s.aux[:, slot].float(), hs[k][0].float().cpu(), dim=-1)
            worst = min(worst, float(c.min()))
        normed = base.norm(s.final.to(device, hs[-1].dtype)[None])  # final is pre-norm
        c = torch.nn.functional.cosine_similarity(normed[0].float().cpu(), hs[-1][0].float().cpu(), dim=-1)
        worst = min(worst, float(c.min()))
    return {"samples_checked": len(picks), "min_token_cosine": worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.environ.get("EYAS_GPU_TARGET", "smollm2-135m-instruct"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--store-dir", default=None, help="where the store goes (/dev/shm on the GPU)")
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--writers", type=int, default=None)
    ap.add_argument("--naive-max-tokens", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--also", default=None, help="more eyas runs, 'BATCH_TOKENS:WRITERS,...' (0 = auto)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    device = resolve_device(a.device)
    target = resolve_target(a.target)
    src = open_prepared(a.data)
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-", dir=a.store_dir))
    note = []
    if src.manifest["target"] != target.identity:
        if src.manifest["target"].get("tokenizer") != target.identity["tokenizer"]:
            sys.exit("the prepared data was tokenized for another tokenizer; prepare it for this target")
        note.append(
            "prepared data re-labelled for this machine's conversion of the same target "
            f"(tokenizer fingerprint equal; ids {src.manifest['target']['id']} -> {target.id})"
        )
    data = subset(src, target, a.max_samples, work / "data")
    ds = open_prepared(data, target)
    warm = subset(ds, target, 32, work / "warm")
    cfg = target.config()
    aux, _ = resolve_layers(int(cfg["num_hidden_layers"]))
    on_cuda = device.startswith("cuda")
    bt = a.batch_tokens or (65536 if on_cuda else 4096)
    plan = plan_batches(ds.lengths, bt)
    padded = sum(len(b) * int(ds.lengths[b].max()) for b in plan)
    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": (torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu")
        + f", {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "device": device,
        "store_dir": str(work),
        "samples": len(ds),
        "tokens": int(ds.lengths.sum()),
        "mean_len": float(ds.lengths.mean()),
        "max_len": int(ds.lengths.max()),
        "batch_tokens": bt,
        "batches": len(plan),
        "padding_fraction": 1 - int(ds.lengths.sum()) / padded,
        "aux_layers": aux,
        "notes": note,
    }
    print(json.dumps(info, indent=1), flush=True)

    extract(
        ExtractConfig(
            target=str(target.path),
            data=warm,
            out=work / "warm-store",
            layers=aux,
            device=device,
            batch_tokens=bt,
            writers=a.writers,
            progress=False,
        )
    )  # CUDA context, cuBLAS, allocator, page cache
    shutil.rmtree(work / "warm-store")
    model = target.load_model(dtype=torch.bfloat16 if on_cuda else torch.float32, device=device)
    runs = []
    configs = [(bt, a.writers)] + [tuple(int(x) or None for x in c.split(":")) for c in (a.also or "").split(",") if c]
    for cbt, cw in configs:
        try:
            r = extract(
                ExtractConfig(
                    target=str(target.path),
                    data=data,
                    out=work / "store",
                    layers=aux,
                    device=device,
                    batch_tokens=cbt,
                    writers=cw,
                    progress=True,
                )
            )
            r.update(batch_tokens=cbt, writers=cw)
            print("eyas:", r, flush=True)
            if not runs:  # check the first store fully: checksums, shapes, states vs HF
                t = time.perf_counter()
                problems = verify_store(work / "store")
                info["verify"] = {"problems": problems, "seconds": time.perf_counter() - t}
                info["parity_vs_output_hidden_states"] = parity(model, aux, ds, work / "store", device)
                print("verify/parity:", info["verify"], info["parity_vs_output_hidden_states"], flush=True)
            runs.append(r)
        except Exception as e:  # keep measuring the rest; the failure is recorded
            runs.append({"batch_tokens": cbt, "writers": cw, "error": repr(e)})
            print("eyas run failed:", repr(e), flush=True)
        shutil.rmtree(work / "store", ignore_errors=True)  # frees /dev/shm before the next run
    info["eyas_runs"] = runs
    ok = [r for r in runs if "error" not in r]
    ours = ok[0] if ok else {"tokens": 0, "tokens_per_s": 0.0}
    fwd = time_forward(model, aux, ds, bt, device)
    print("forward only:", fwd, flush=True)
    naive = time_naive(model, aux, ds, bt, device, a.naive_max_tokens)
    print("naive:", naive, flush=True)
    info.update(eyas=ours, forward_only=fwd, naive=naive)
    info["load_average"] = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'what':<44}{'tokens':>12}{'tokens/s':>12}")
    rows = [(f"eyas extract, to disk (bt={r['batch_tokens']}, w={r['writers']})", r) for r in ok]
    for name, r in (
        *rows,
        ("forward + hooks only (no copy, no write)", fwd),
        ("naive: output_hidden_states + .to('cpu')", naive),
    ):
        print(f"{name:<44}{r['tokens']:>12,}{r['tokens_per_s']:>12,.0f}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
