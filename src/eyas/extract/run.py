"""The `eyas extract` stage: prepared dataset -> hidden-state store, resumable.

Backends plug in through :data:`BACKENDS`: a backend is a function ``fill(job: ExtractJob)``
that stores every sample in ``job.todo`` through ``job.writer`` (``writer.add`` per sample, or
``writer.submit_shard`` for whole shards) and calls ``job.progress(tokens)`` as it goes. The
stage itself opens the data, checks it against the target, creates or resumes the store, and
prints the summary; it never needs editing for a new backend.

The HF backend's loop (``fill_hf``): a fixed, length-sorted batch plan (right padding only, so
causal attention needs no mask and never sees the pads); per batch one forward of the base
model with hooks writing into one ``[B,T,A+1,H]`` buffer; on CUDA an asynchronous copy into a
reused pinned host buffer on a side stream; shard files written straight from that buffer by
writer threads while the next batches run. Batch k of the plan is shard k, so a resumed run
redoes exactly the unfinished batches and ends with the same store as an uninterrupted one.
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from eyas.device import resolve_device
from eyas.errors import EyasError
from eyas.extract.config import ExtractConfig
from eyas.extract.plan import ExtractPlan, free_space, plan_meta_bytes, rate_estimate, shard_tokens
from eyas.features.format import FLOAT_DTYPES, FP8, Layout, quantize
from eyas.features.layers import CONVENTION, resolve_layers
from eyas.features.writer import ShardItem, StoreWriter, check_finite

# name -> "module:function"; the vLLM backends add their entries here (and their names to --backend's
# values, eyas.extract.config.Backend).
BACKENDS: dict[str, str] = {
    "hf": "eyas.extract.run:fill_hf",
    "vllm": "eyas.extract.vllm_backend:fill_vllm",
    "vllm-hooks": "eyas.extract.vllm_backend:fill_vllm_hooks",
}


def resolve_auto_backend(backend: str, vllm_python: str | None) -> tuple[str, str, str | None]:
    """``auto`` -> a concrete backend by the installed vLLM version (hf when there is none);
    returns (backend, why, the vLLM version it runs with or None)."""
    if backend not in ("auto", "vllm", "vllm-hooks"):
        return backend, "", None
    from eyas.extract.vllm_backend import resolve_backend

    try:
        chosen, inst, why = resolve_backend(backend, vllm_python)
    except EyasError as e:
        if backend == "auto" and "no vLLM found" in str(e):
            return "hf", "auto: hf, because no vLLM was found (" + str(e) + ")", None
        raise
    return chosen, why, inst.version


@dataclass
class ExtractJob:
    """Everything a backend needs to fill a store."""

    target: Any  # eyas.target.Target
    dataset: Any  # eyas.data.dataset.PreparedDataset
    todo: list[int]  # sample indices not yet in the store, ascending
    writer: StoreWriter
    aux_layers: list[int]
    final_layer: int
    dtype: str  # store dtype name: bf16 / fp16 / fp32 / fp8 (writer.layout says how)
    device: str
    batch_tokens: int
    progress: Callable[[int], None] = lambda n: None
    options: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)  # backends set "t_first_batch" (perf_counter)


def plan_batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches whose padded size (rows x longest) stays within ``batch_tokens``.

    Deterministic in the lengths alone, so a resumed run sees the same batches (= shards).
    """
    order = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths)))  # longest first, stable
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order.tolist():
        longest = int(lengths[cur[0]]) if cur else int(lengths[i])
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


# ------------------------------------------------------------------------------------ HF


class _HostBuffers:
    """A pool of reusable host buffers (pinned on CUDA): states of ``numel`` elements, token ids,
    a finiteness flag, and (fp8) ``scale_numel`` fp32 scales."""

    def __init__(self, count: int, numel: int, ids_numel: int, dtype: torch.dtype, pin: bool, scale_numel: int = 0):
        self.free: queue.Queue = queue.Queue()
        for _ in range(count):
            self.free.put(
                (
                    torch.empty(numel, dtype=dtype, pin_memory=pin),
                    torch.empty(ids_numel, dtype=torch.int64, pin_memory=pin),
                    torch.empty((), dtype=torch.bool, pin_memory=pin),
                    torch.empty(scale_numel, dtype=torch.float32, pin_memory=pin),
                )
            )

    def get(self):
        return self.free.get()

    def put(self, buf) -> None:
        self.free.put(buf)


def fill_hf(job: ExtractJob) -> None:
    """The HF backend: transformers + forward hooks, any device."""
    from eyas.features.capture import HiddenStateCapture

    device = job.device
    on_cuda = device.startswith("cuda")
    model_dtype = job.options.get("model_dtype") or ("bf16" if on_cuda else "fp32")
    model = job.target.load_model(dtype=FLOAT_DTYPES[model_dtype], device=device)
    cap = HiddenStateCapture(model, job.aux_layers)
    layout: Layout = job.writer.layout
    store_dtype = layout.state_dtype
    slots, hidden, groups = cap.num_slots, cap.hidden_size, layout.scale_groups
    lengths = job.dataset.lengths
    todo = set(job.todo)
    work = []  # (shard id, sample indices) in plan order
    for sid, batch in enumerate(plan_batches(lengths, job.batch_tokens)):
        rest = [i for i in batch if i in todo]
        if rest:
            work.append((sid, rest))
    if not work:
        return
    cap_tokens = max(job.batch_tokens, int(lengths.max()))
    nbuf = int(job.options.get("host_buffers") or (job.options.get("writers", 4) + 3))
    pool = _HostBuffers(
        nbuf, cap_tokens * slots * hidden, cap_tokens, store_dtype, pin=on_cuda, scale_numel=cap_tokens * slots * groups
    )
    copy_stream = torch.cuda.Stream(device=device) if on_cuda else None
    writer = job.writer
    job.stats["t_first_batch"] = time.perf_counter()  # throughput counts from here to the last shard
    for sid, idx in work:
        rows = [job.dataset[i] for i in idx]
        B, T = len(rows), max(len(r.input_ids) for r in rows)
        host, ids_host, flag_host, scale_host = buf = pool.get()
        ids_np = ids_host[: B * T].view(B, T).numpy()
        ids_np.fill(0)  # right padding: causal attention never reads these positions
        for b, r in enumerate(rows):
            ids_np[b, : len(r.input_ids)] = r.input_ids
        hv = host[: B * T * slots * hidden].view(B, T, slots, hidden)
        sv = scale_host[: B * T * slots * groups].view(B, T, slots, groups) if layout.quantized else None
        if on_cuda:
            ids = ids_host[: B * T].view(B, T).to(device, non_blocking=True)
            states = cap.capture_into(
                ids,
                out=None if layout.quantized else torch.empty((B, T, slots, hidden), dtype=store_dtype, device=device),
            )
            if layout.quantized:  # on the device: half the bytes cross to the host
                states, scale = quantize(states, groups)
                # a NaN/Inf state makes its scale non-finite: checking the scales is enough
                finite = torch.isfinite(scale.sum())
            else:
                scale = None
                # one reduction instead of a full-size isfinite mask; non-finite -> checked per sample
                finite = torch.isfinite(states.sum(dtype=torch.float32))
            copy_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(copy_stream):
                hv.copy_(states, non_blocking=True)
                if scale is not None:
                    sv.copy_(scale, non_blocking=True)
                flag_host.copy_(finite, non_blocking=True)  # pinned: a pageable target would block
                finite_host = flag_host
                event = torch.cuda.Event()
                event.record(copy_stream)
            for t in (states, finite) if scale is None else (states, finite, scale):
                t.record_stream(copy_stream)
        elif layout.quantized:
            states = cap.capture_into(torch.from_numpy(ids_np.copy()))
            q, scale = quantize(states, groups)
            hv.copy_(q)
            sv.copy_(scale)
            event, finite_host = None, None
        else:
            cap.capture_into(torch.from_numpy(ids_np.copy()), out=hv)  # hooks write into the host buffer
            event, finite_host = None, None
        items = [
            ShardItem(
                r.index,
                r.input_ids,
                r.loss_mask,
                hv[b, : len(r.input_ids)],
                None if sv is None else sv[b, : len(r.input_ids)],
            )
            for b, r in enumerate(rows)
        ]

        def before(event=event, finite_host=finite_host, items=items) -> None:
            if event is not None:
                event.synchronize()
            if finite_host is None or not bool(finite_host):
                for it in items:
                    check_finite(it.states if it.scale is None else it.scale, it.index)

        writer.submit_shard(items, shard_id=sid, before=before, after=lambda buf=buf: pool.put(buf))
    writer.wait()
    cap.remove()


# --------------------------------------------------------------------------------- stage


def _load_backend(name: str) -> Callable[[ExtractJob], None]:
    spec = BACKENDS.get(name)
    if spec is None:
        raise EyasError(f"--backend {name!r}: unknown; choose one of {sorted(BACKENDS)}")
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _check_dtypes(dtype: str, fp8_group_size: int | None) -> None:
    if fp8_group_size is not None and dtype != FP8:
        raise EyasError(
            f"--fp8-group-size {fp8_group_size}: only for --dtype fp8 (this run stores "
            f"{dtype}); drop it or pass --dtype fp8"
        )


def _scale_groups(dtype: str, hidden: int, fp8_group_size: int | None) -> int | None:
    """fp8: scales per token and state (``hidden / fp8_group_size``; 1 without a group size)."""
    if dtype != FP8:
        return None
    if fp8_group_size is None:
        return 1
    if hidden % fp8_group_size:
        raise EyasError(
            f"--fp8-group-size {fp8_group_size}: must divide the target's hidden size "
            f"{hidden}; leave it out for one scale per token and state"
        )
    return hidden // fp8_group_size


def _stored_samples(out: Path) -> set[int]:
    """Samples an earlier run committed to ``out`` (its shard records whose files exist)."""
    from eyas.features.reader import committed_records

    if not Path(out).is_dir():
        return set()
    return {i for r in committed_records(Path(out)).values() for i in r["samples"]["index"]}


def make_plan(
    tgt, ds, out: Path, fields: dict[str, Any], batch_tokens: int, device: str, backend: str, gpus: int, done: set[int]
) -> ExtractPlan:
    """The disk and time plan of filling ``out`` (see :mod:`eyas.extract.plan`)."""
    from eyas.features.writer import store_fields

    _, layout = store_fields(fields, str(out))
    lengths = ds.lengths
    todo = set(range(len(ds))) - done
    per_shard = shard_tokens(lengths, plan_batches(lengths, batch_tokens), todo)
    free, where = free_space(out)
    rate, note = rate_estimate(tgt.path, tgt.config(), device, backend, gpus)
    return ExtractPlan(
        out=Path(out),
        layout=layout,
        samples=len(ds),
        samples_todo=len(todo),
        tokens=int(lengths.sum()),
        tokens_todo=int(sum(per_shard)),
        shards_todo=len(per_shard),
        shard_bytes_todo=int(sum(layout.shard_bytes(n) for n in per_shard)),
        meta_bytes=plan_meta_bytes(len(per_shard), len(todo)),
        free_bytes=free,
        free_where=where,
        tokens_per_s=rate,
        rate_note=note,
    )


def run(cfg: ExtractConfig) -> Path:
    """The extract stage's entry point (`eyas extract`, the pipeline): :func:`extract`, then what it
    stored on stderr; returns the store directory. ``plan_only``: the plan on stdout, nothing written."""
    if cfg.plan_only:
        s = extract(replace(cfg, progress=False))
        print("\n".join(s["lines"]), flush=True)  # stdout: the answer to --plan, for scripts too
        return Path(cfg.out)
    s = extract(cfg)
    print(
        f"stored {s['samples']} samples ({s['resumed_from']} were already there): {s['tokens']:,} tokens "
        f"this run, {s['bytes'] / 1e9:.3f} GB, {s['bytes_per_token']:.0f} B/token, {s['seconds']:.1f} s, "
        f"{s['tokens_per_s']:,.0f} tokens/s -> {cfg.out}",
        file=sys.stderr,
        flush=True,
    )
    return Path(cfg.out)


def extract(cfg: ExtractConfig) -> dict[str, Any]:
    """Fill (or finish) the store at ``cfg.out``; returns the summary (tokens, bytes, tokens/s) for
    callers that want the figures (:func:`run` is the stage's entry point).

    Before any work it plans the bytes to write and the time (printed when ``progress``) and
    refuses when the filesystem of ``out`` has less free space. ``plan_only``: return the plan
    (``{"plan": ...}``), write nothing. ``out`` is checked first (a folder this process can write,
    apart from the inputs) and held by this process alone while it is written.
    """
    from eyas.outdir import check_out, writer_lock

    check_out(cfg.out, inputs={"the prepared dataset --data": cfg.data, "the --target": cfg.target})
    if cfg.plan_only:
        return _extract(cfg)
    with writer_lock(cfg.out, command="eyas extract"):
        return _extract(cfg)


def _extract(cfg: ExtractConfig) -> dict[str, Any]:
    from eyas.data.dataset import open_prepared
    from eyas.features.writer import check_resumable
    from eyas.target import resolve_target

    out = Path(cfg.out)
    _check_dtypes(cfg.dtype, cfg.fp8_group_size)
    backend, why, vllm_version = resolve_auto_backend(cfg.backend, cfg.vllm_python)
    if why and cfg.progress:
        print(f"eyas extract: backend {why}", file=sys.stderr, flush=True)
    fill = _load_backend(backend)
    tgt = resolve_target(cfg.target)
    ds = open_prepared(cfg.data, tgt)
    tcfg = tgt.config()
    text_cfg = tcfg.get("text_config", tcfg)
    aux, final_id = resolve_layers(int(text_cfg["num_hidden_layers"]), cfg.layers)
    device = resolve_device(cfg.device)
    on_cuda = device.startswith("cuda")
    batch_tokens = int(cfg.batch_tokens or (65536 if on_cuda else 4096))
    # On CUDA the disk side is the bottleneck: 16 writers beat 8 on the H200 host (benchmarks/extract_results.md).
    writers = int(cfg.writers or (min(16, os.cpu_count() or 16) if on_cuda else 2))
    hidden = int(text_cfg["hidden_size"])
    fields = {
        "target": tgt.identity,
        "aux_layers": aux,
        "final_layer": final_id,
        "convention": CONVENTION,
        "dtype": cfg.dtype,
        "hidden_size": hidden,
        "scale_groups": _scale_groups(cfg.dtype, hidden, cfg.fp8_group_size),
        "prepared_id": ds.manifest.get("id"),
        "prepared_path": str(Path(cfg.data).resolve()),
        "num_samples": len(ds),
        "backend": backend,
        "plan": {"batch_tokens": batch_tokens},
    }
    check_resumable(out, fields)  # other settings are refused before the plan, as by the writer
    plan = make_plan(
        tgt,
        ds,
        out,
        fields,
        batch_tokens,
        device,
        backend,
        cfg.tensor_parallel_size * cfg.data_parallel_size,
        _stored_samples(out),
    )
    if cfg.plan_only:
        return {"plan": plan.as_dict(), "lines": plan.lines()}
    if cfg.progress:
        print("eyas extract " + "\n".join(plan.lines()), file=sys.stderr, flush=True)
    plan.check_space()
    writer = StoreWriter(out, fields, shard_tokens=batch_tokens, num_writers=writers, max_pending=writers + 1)
    for bad in writer.rewritten:
        print(
            f"eyas extract: {out}: stored shard {bad} failed its checksum and is extracted again",
            file=sys.stderr,
            flush=True,
        )
    todo = [i for i in range(len(ds)) if i not in writer.done]
    job = ExtractJob(
        target=tgt,
        dataset=ds,
        todo=todo,
        writer=writer,
        aux_layers=aux,
        final_layer=final_id,
        dtype=cfg.dtype,
        device=device,
        batch_tokens=batch_tokens,
        options={
            "writers": writers,
            "model_dtype": cfg.model_dtype,
            "vllm_python": cfg.vllm_python,
            "vllm_requested": cfg.backend,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "data_parallel_size": cfg.data_parallel_size,
        },
    )
    checked_first = _self_check_first(cfg, job, backend, vllm_version)
    elapsed, manifest = _fill(fill, job, backend, out, cfg.progress)
    tokens = writer.tokens_written
    return {
        "tokens": tokens,
        "bytes": writer.bytes_written,
        "bytes_per_token": writer.bytes_written / tokens if tokens else 0.0,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed if tokens and elapsed else 0.0,
        "store_tokens": manifest["tokens"],
        "samples": len(ds),
        "resumed_from": len(ds) - len(todo),
        "planned_shard_bytes": plan.shard_bytes_todo,
        "self_check": checked_first,
    }


def _self_check_first(
    cfg: ExtractConfig, job: ExtractJob, backend: str, vllm_version: str | None
) -> dict[str, Any] | None:
    """The self-check of a vLLM backend on a version eyas has not tested (:mod:`eyas.extract.selfcheck`);
    None where it does not run. A failed check leaves the store as it was."""
    if not (cfg.self_check and job.todo and vllm_version is not None):
        return None
    from eyas.extract.backends import vllm_tested
    from eyas.extract.selfcheck import self_check

    status = vllm_tested(vllm_version, backend)
    if status.tested:
        return None
    try:
        return self_check(
            cfg.target,
            job.target,
            job.dataset,
            job.todo,
            cfg.self_check,
            backend,
            Path(cfg.out),
            job.aux_layers,
            job.device,
            cfg.model_dtype,
            cfg.vllm_python,
            cfg.tensor_parallel_size,
            status.note,
        )
    except BaseException:
        job.writer.abort()
        raise


def _fill(
    fill: Callable[[ExtractJob], None], job: ExtractJob, backend: str, out: Path, progress: bool
) -> tuple[float, dict[str, Any]]:
    """Run the backend over ``job.todo`` and close the store; returns the seconds from its first batch
    and the store's manifest."""
    from tqdm import tqdm

    ds, writer = job.dataset, job.writer
    total = int(ds.lengths[job.todo].sum()) if job.todo else 0
    bar = tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=f"extract ({backend}, {job.device})",
        disable=not progress,
        smoothing=0.1,
    )
    start = time.perf_counter()
    writer.on_commit = lambda rec: bar.update(rec["tokens"])
    try:
        fill(job)
        manifest = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if not manifest["complete"]:
        missing = sorted(set(range(len(ds))) - writer.done)
        raise EyasError(
            f"store {out}: backend {backend!r} left {len(missing)} samples unstored "
            f"(first {missing[:5]}); re-run to finish"
        )
    return time.perf_counter() - job.stats.get("t_first_batch", start), manifest
