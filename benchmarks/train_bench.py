"""`eyas train` throughput and model FLOP utilisation (MFU), offline and online.

    python benchmarks/train_bench.py --target DIR --data PREPARED --work /dev/shm/eyas-tb \
        [--modes online,offline] [--batch-sizes 1,4] [--steps 40] [--warmup-steps 8] [--json OUT] \
        [--attention auto|dense|flex] [--parallel ddp|fsdp2]
    torchrun --nproc-per-node 8 benchmarks/train_bench.py ... --parallel fsdp2   # several GPUs

Each configuration runs the real trainer (`eyas.train.trainer.run`: packing, features, TTT
forward/backward, AdamW, logging) for warmup + measured steps; tokens/s comes from the trainer's
own per-step log (real tokens, padding excluded) over the measured steps only. Offline first
extracts a store with `eyas extract`'s HF backend (not timed).

FLOPs counted per real token (training = 3x forward for matmuls with weight and input grads):
  draft matmuls  ttt * 3 * 2 * (qkv + o + mlp + lm_head params) + 2 * 2 * fc params
  attention      dense: ttt * 3 * 4 * T_pack * heads * head_dim (every query row against T keys, as executed)
                 flex:  the 128x128 tiles the BlockMask lets the kernel run (partial + full), counted from the
                        epoch-0 training packs' document layout: per step j, block 0 tiles (document-causal)
                        + j diagonal-block tiles; 3 * 4 * 128*128 * head_dim * heads per tile, per real token
  target head    2 * H * draft_vocab (no grad)            online target: 2 * non-embedding params
  model          the draft matmuls training needs: the layer and fc on every position, lm_head only on
                 the positions the loss scores (per TTT step j: loss mask at i+2+j, same document; counted
                 from the epoch-0 packs). The default loss runs lm_head on every position (``draft_matmul``
                 above); --fused-loss runs it on the scored ones only, and the target head once per batch
                 on them (``executed``).
MFU = model FLOP/s / peak (H200 bf16 dense 989.4 TFLOP/s unless --peak-tflops). ``mfu_draft_matmul``
(lm_head on every position) is the figure reported before the fifth session of 2026-11-30, kept for comparison.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from eyas.data.dataset import open_prepared, write_prepared
from eyas.draft.model import DraftConfig
from eyas.target import resolve_target
from eyas.train.packing import pack_indices, split_indices
from eyas.train.parallel import setup_dist
from eyas.train.trainer import TrainConfig, run as train

TILE = 128  # flex_attention's default BLOCK_SIZE


def rewrite_for(ds, target, out: Path, n: int | None) -> Path:
    """The first ``n`` samples' tokens as a prepared dataset of ``target`` (identity differs across machines)."""
    if out.exists():
        shutil.rmtree(out)
    rows = [ds[i] for i in range(min(n or len(ds), len(ds)))]
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


def flops_per_token(
    cfg: DraftConfig, ttt: int, pack: int, target_cfg: dict, fractions: list[float], fused: bool
) -> dict[str, float]:
    h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layer = 2 * h * (nh * d + 2 * nkv * d) + nh * d * h + 3 * h * cfg.intermediate_size
    per_step = layer + h * cfg.draft_vocab_size
    fc = cfg.num_aux * cfg.target_hidden_size * h
    tc = target_cfg.get("text_config", target_cfg)
    th, ti, tl = tc["hidden_size"], tc["intermediate_size"], tc["num_hidden_layers"]
    thd = tc.get("head_dim") or th // tc["num_attention_heads"]
    tparams = tl * (
        th * thd * (tc["num_attention_heads"] + 2 * tc.get("num_key_value_heads", tc["num_attention_heads"]))
        + tc["num_attention_heads"] * thd * th
        + 3 * th * ti
    )
    head = h * cfg.draft_vocab_size
    scored = sum(fractions)
    return {
        "draft_matmul": ttt * 3 * 2 * per_step + 2 * 2 * fc,
        "model": ttt * 3 * 2 * layer + 3 * 2 * head * scored + 2 * 2 * fc,
        "attention": ttt * 3 * 4 * pack * nh * d,
        # fused: once per batch, on the positions whose next token the loss counts (~ step 0's)
        "target_head": 2 * head * (fractions[0] if fused else 1.0),
        "online_target": 2 * tparams,
    }


def flex_tiles(doc: np.ndarray, steps: int) -> int:
    """128x128 tiles flex runs over all TTT steps for one pack's doc ids [T] (-1 = padding, last)."""
    t = len(doc)
    nq = -(-t // TILE)
    d = np.where(doc < 0, doc.max() + 1, doc)  # padding is one more "document" at the end
    lo = [d[a * TILE : (a + 1) * TILE].min() for a in range(nq)]
    hi = [d[a * TILE : (a + 1) * TILE].max() for a in range(nq)]
    # block 0: kv tile b <= q tile a is visible iff the tiles share a document (documents are contiguous)
    block0 = sum(1 for a in range(nq) for b in range(a + 1) if hi[b] >= lo[a])
    # block n >= 1: kv tiles touched by the diagonal kv = n*T + q, per q tile
    diag = [
        sum((n * t + min((a + 1) * TILE, t) - 1) // TILE - (n * t + a * TILE) // TILE + 1 for a in range(nq))
        for n in range(steps)
    ]
    return sum(block0 + sum(diag[1 : j + 1]) for j in range(steps))


def epoch0_packs(ds, pack: int, seed: int = 0):
    """Per training pack of epoch 0 (as the trainer packs them): the cut documents' loss masks."""
    train_idx, _ = split_indices(len(ds), 0.01)
    for p in pack_indices(train_idx, ds.lengths, pack, seed=seed * 100003):
        masks, at = [], 0
        for i in p:
            n = min(int(ds.lengths[i]), pack - at)
            masks.append(np.asarray(ds[i].loss_mask[:n], bool))
            at += n
        yield masks


def scored_fractions(ds, pack: int, ttt: int, seed: int = 0) -> list[float]:
    """Per TTT step j: positions the loss scores (x[i+2+j] in the loss mask and the document) per real token."""
    scored, real = np.zeros(ttt), 0
    for masks in epoch0_packs(ds, pack, seed):
        for m in masks:
            scored += [m[2 + j :].sum() for j in range(ttt)]
            real += len(m)
    return (scored / max(real, 1)).tolist()


def attention_flops_per_token(cfg: DraftConfig, ttt: int, pack: int, kind: str, ds, seed: int = 0) -> float:
    """Training attention FLOPs per real token as executed (see the module docstring)."""
    nh, d = cfg.num_attention_heads, cfg.head_dim
    if kind == "dense":
        return ttt * 3 * 4 * pack * nh * d
    tiles = real = 0
    for masks in epoch0_packs(ds, pack, seed):
        doc = np.full(pack, -1, np.int64)
        at = 0
        for k, m in enumerate(masks):
            doc[at : at + len(m)] = k
            at += len(m)
        tiles += flex_tiles(doc, ttt)
        real += at
    return 3 * 4 * TILE * TILE * d * nh * tiles / max(real, 1)


def measure(run: Path, warmup: int) -> dict[str, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r["split"] == "train"]
    tokens, seconds, warm_s, prev = 0, 0.0, 0.0, 0
    for r in recs:
        step_tokens = r["tokens"] - prev
        prev = r["tokens"]
        if r["step"] > warmup:
            tokens += step_tokens
            seconds += step_tokens / r["tokens_per_s"]
        else:  # compilation included
            warm_s += step_tokens / r["tokens_per_s"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "warmup_s": warm_s,
        "steps": len(recs) - warmup,
        "final_loss": recs[-1]["loss"],
        "acc_step0": recs[-1]["acc"][0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, help="a prepared dataset (its tokens are reused)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--max-samples", type=int, default=None, help="use the first N samples only")
    ap.add_argument("--modes", default="online,offline")
    ap.add_argument("--batch-sizes", default="1,4", help="packs per micro-batch to try")
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--compile", default="0", help="comma list of 0/1: torch.compile variants")
    ap.add_argument("--fused-loss", action="store_true", help="train with --fused-loss")
    ap.add_argument("--compile-scope", default="model", help="model or regions (eyas train --compile-scope)")
    ap.add_argument(
        "--compile-mode",
        default="default",
        help="torch.compile mode for --compile-scope model (eyas train --compile-mode)",
    )
    ap.add_argument("--loss-chunk", type=int, default=4096, help="rows per chunk of --fused-loss")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--attention", default="auto", help="TTT attention: auto, dense or flex (trainer's --attention)")
    ap.add_argument("--parallel", default="ddp", help="ddp or fsdp2 (used under torchrun with >1 process)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="N > 0: also profile N steady steps of the first configuration (torch.profiler), "
        "written next to --json as profile-<config>.txt",
    )
    args = ap.parse_args()

    # under torchrun every rank trains; rank 0 alone prepares files, measures and reports
    dist, _ = setup_dist(args.device)
    main_rank = dist.rank == 0
    work = Path(args.work)
    target = resolve_target(args.target)
    if main_rank:
        work.mkdir(parents=True, exist_ok=True)
        rewrite_for(open_prepared(args.data), target, work / "data", args.max_samples)
    dist.barrier()
    data = work / "data"
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    attention = args.attention if args.attention != "auto" else ("flex" if cuda else "dense")
    peak = args.peak_tflops or (989.4 if cuda else None)
    device_name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    results = []
    store = None
    for mode in args.modes.split(","):
        if mode == "offline" and store is None:
            from eyas.extract.config import ExtractConfig
            from eyas.extract.run import extract

            store = work / "store"
            if main_rank:
                if store.exists():
                    shutil.rmtree(store)
                t0 = time.perf_counter()
                s = extract(
                    ExtractConfig(
                        target=str(target.path), data=data, out=store, dtype="bf16", device=args.device, progress=False
                    )
                )
                print(f"store: {s['tokens']:,} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
            dist.barrier()
        for bs in [int(x) for x in args.batch_sizes.split(",")]:
            for comp in [bool(int(x)) for x in args.compile.split(",")]:
                tag = (
                    ("-regions" if comp and args.compile_scope == "regions" else "")
                    + (f"-{args.compile_mode}" if comp and args.compile_mode != "default" else "")
                    + (f"-fused{args.loss_chunk}" if args.fused_loss else "")
                )
                run = work / f"run-{mode}-b{bs}-c{int(comp)}{tag}-{attention}-w{dist.world}"
                if main_rank and run.exists():
                    shutil.rmtree(run)
                dist.barrier()
                cfg = TrainConfig(
                    target=str(target.path),
                    data=str(data),
                    out=str(run),
                    features=mode,
                    store=str(store) if mode == "offline" else None,
                    ttt_steps=args.ttt_steps,
                    tokens_per_batch=args.tokens_per_batch,
                    batch_size=bs,
                    max_steps=args.warmup_steps + args.steps,
                    warmup=5,
                    save_every=0,
                    eval_every=0,
                    eval_batches=1,
                    heldout=0.01,
                    device=args.device,
                    progress=False,
                    compile=comp,
                    compile_scope=args.compile_scope,
                    compile_mode=args.compile_mode,
                    fused_loss=args.fused_loss,
                    loss_chunk=args.loss_chunk,
                    attention=args.attention,
                    parallel=args.parallel,
                    experimental=True,
                )  # a benchmark measures the experimental settings too
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                try:
                    draft_dir = train(cfg)
                except Exception as e:  # record and go on: one failing variant must not lose the rest
                    print(f"{mode} b{bs} compile={comp}: FAILED {type(e).__name__}: {e}", flush=True)
                    results.append(
                        {
                            "mode": mode,
                            "batch_packs": bs,
                            "compile": comp,
                            "attention": attention,
                            "error": str(e)[:500],
                        }
                    )
                    continue
                wall = time.perf_counter() - t0
                peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
                if args.profile and main_rank and not results and dist.world == 1:
                    try:
                        profile(cfg, run.name, args)  # a separate run, after the timed one
                    except Exception as e:  # the measurement above stands without it
                        print(f"profile of {run.name}: FAILED {type(e).__name__}: {e}", flush=True)
                if not main_rank:
                    continue
                m = measure(run, args.warmup_steps)
                dcfg = DraftConfig.from_dict(json.loads((draft_dir / "config.json").read_text()))
                fractions = scored_fractions(open_prepared(data), args.tokens_per_batch, args.ttt_steps)
                f = flops_per_token(
                    dcfg, args.ttt_steps, args.tokens_per_batch, target.config(), fractions, args.fused_loss
                )
                f["attention"] = attention_flops_per_token(
                    dcfg, args.ttt_steps, args.tokens_per_batch, attention, open_prepared(data)
                )
                # what this configuration runs: lm_head on every position, or (fused) on the scored ones
                matmuls = f["model"] if args.fused_loss else f["draft_matmul"]
                executed = matmuls + f["attention"] + f["target_head"] + (f["online_target"] if mode == "online" else 0)
                tps = m["tokens_per_s"]
                row = {
                    "mode": mode,
                    "batch_packs": bs,
                    "compile": comp,
                    "compile_scope": args.compile_scope if comp else None,
                    "compile_mode": args.compile_mode if comp else None,
                    "loss_chunk": args.loss_chunk if args.fused_loss else None,
                    "attention": attention,
                    "fused_loss": args.fused_loss,
                    "parallel": args.parallel if dist.world > 1 else "single",
                    "world_size": dist.world,
                    **m,
                    "wall_s_total": wall,
                    "max_memory_allocated_gib": peak_mem,
                    "scored_fraction_per_step": fractions,
                    "flops_per_token": f,
                    "model_tflops": f["model"] * tps / 1e12,
                    "draft_matmul_tflops": f["draft_matmul"] * tps / 1e12,
                    "executed_tflops": executed * tps / 1e12,
                }
                if peak:  # per-GPU peak times the GPUs training
                    row["mfu"] = row["model_tflops"] / (peak * dist.world)
                    row["mfu_draft_matmul"] = row["draft_matmul_tflops"] / (peak * dist.world)
                    row["hfu_executed"] = row["executed_tflops"] / (peak * dist.world)
                results.append(row)
                report(args, device_name, peak, data, results)
                print(
                    f"{mode:8} packs/micro={bs} compile={int(comp)}"
                    f"{'/model' if comp and args.compile_scope == 'model' else ''}"
                    f"{'/' + args.compile_mode if comp else ''} fused={int(args.fused_loss)} {attention} "
                    f"x{dist.world}  {tps:>12,.0f} tok/s  model {row['model_tflops']:.1f} TFLOP/s"
                    + (
                        f"  MFU {row['mfu']:.1%} (lm_head on all positions: {row['mfu_draft_matmul']:.1%}; "
                        f"executed FLOPs {row['hfu_executed']:.1%})"
                        if peak
                        else ""
                    )
                    + f"  warm-up {m['warmup_s']:.1f} s  loss {m['final_loss']:.3f}",
                    flush=True,
                )
    if main_rank:
        print(json.dumps(report(args, device_name, peak, data, results)))


def profile(cfg: TrainConfig, name: str, args) -> None:
    """Kernel time by op over ``args.profile`` steady steps of ``cfg`` (a separate short run).

    The trainer has no per-step hook, so the profiler's schedule advances on every optimizer step
    through torch's global optimizer hook; the warm-up (compilation included) is not recorded.
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile as torch_profile, schedule

    run = Path(cfg.out + "-profile")
    if run.exists():
        shutil.rmtree(run)
    cfg = replace(cfg, out=str(run), max_steps=args.warmup_steps + args.profile + 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    marks: list[float] = []
    with torch_profile(
        activities=acts, schedule=schedule(wait=args.warmup_steps, warmup=1, active=args.profile, repeat=1)
    ) as prof:
        first: list[int] = []

        def on_step(opt, *_):
            # --optimizer muon steps two optimizers per training step: count the first one only
            if first and first[0] != id(opt):
                return
            first[:] = [id(opt)]
            marks.append(time.perf_counter())
            prof.step()

        handle = register_optimizer_step_post_hook(on_step)
        try:
            train(cfg)
        finally:
            handle.remove()
    wall = marks[args.warmup_steps + 1 + args.profile - 1] - marks[args.warmup_steps]  # the active steps
    events = prof.key_averages()
    # kernels only, as the table's "Self CUDA time total": user annotations (ProfilerStep*) repeat
    # their kernels' time; counting them gave >100% of wall before
    dev_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = (
        f"{args.profile} steps profiled ({name}): wall {wall:.3f} s, {wall / args.profile * 1e3:.1f} ms/step; "
        f"GPU kernel time {dev_us / 1e6:.3f} s ({dev_us / 1e6 / max(wall, 1e-9):.0%} of wall)\n\n"
        + events.table(sort_by=by, row_limit=45, max_name_column_width=70)
        + "\n\nBy self CPU time (where the host's time goes):\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    )
    out = Path(args.json).parent if args.json else Path(args.work)
    (out / f"profile-{name}.txt").write_text(text)
    print(text.split("\n\n")[0], flush=True)


def report(args, device_name: str, peak, data: Path, results: list) -> dict:
    """The result record; rewritten after every configuration so a cut-off run keeps what it measured."""
    rep = {
        "benchmark": "train_bench",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": device_name,
        "torch": torch.__version__,
        "peak_tflops": peak,
        "command": " ".join(sys.argv),
        "tokens_per_batch": args.tokens_per_batch,
        "ttt_steps": args.ttt_steps,
        "samples": len(open_prepared(data)),
        "results": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return rep


if __name__ == "__main__":
    main()
