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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import typer

from eyas.device import resolve_device
from eyas.checks import checked
from eyas.errors import EyasError
from eyas.extract.layers import CONVENTION, parse_layers, resolve_layers
from eyas.extract.store import DTYPES, ShardItem, StoreWriter, check_finite, verify_store

# name -> "module:function"; the vLLM backends add their entries here.
BACKENDS: dict[str, str] = {"hf": "eyas.extract.run:fill_hf",
                            "vllm": "eyas.extract.vllm_backend:fill_vllm",
                            "vllm-hooks": "eyas.extract.vllm_backend:fill_vllm_hooks"}


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

    target: Any                      # eyas.target.Target
    dataset: Any                     # eyas.data.dataset.PreparedDataset
    todo: list[int]                  # sample indices not yet in the store, ascending
    writer: StoreWriter
    aux_layers: list[int]
    final_layer: int
    dtype: str                       # store dtype name: bf16 / fp16 / fp32
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
    """A pool of reusable host buffers (pinned on CUDA) of ``numel`` elements each."""

    def __init__(self, count: int, numel: int, ids_numel: int, dtype: torch.dtype, pin: bool):
        self.free: queue.Queue = queue.Queue()
        for _ in range(count):
            self.free.put((torch.empty(numel, dtype=dtype, pin_memory=pin),
                           torch.empty(ids_numel, dtype=torch.int64, pin_memory=pin),
                           torch.empty((), dtype=torch.bool, pin_memory=pin)))

    def get(self):
        return self.free.get()

    def put(self, buf) -> None:
        self.free.put(buf)


def fill_hf(job: ExtractJob) -> None:
    """The HF backend: transformers + forward hooks, any device."""
    from eyas.extract.hf import HiddenStateCapture

    device = job.device
    on_cuda = device.startswith("cuda")
    model_dtype = job.options.get("model_dtype") or ("bf16" if on_cuda else "fp32")
    model = job.target.load_model(dtype=DTYPES[model_dtype], device=device)
    cap = HiddenStateCapture(model, job.aux_layers)
    store_dtype = DTYPES[job.dtype]
    slots, hidden = cap.num_slots, cap.hidden_size
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
    pool = _HostBuffers(nbuf, cap_tokens * slots * hidden, cap_tokens, store_dtype, pin=on_cuda)
    copy_stream = torch.cuda.Stream(device=device) if on_cuda else None
    writer = job.writer
    job.stats["t_first_batch"] = time.perf_counter()  # throughput counts from here to the last shard
    for sid, idx in work:
        rows = [job.dataset[i] for i in idx]
        B, T = len(rows), max(len(r.input_ids) for r in rows)
        host, ids_host, flag_host = buf = pool.get()
        ids_np = ids_host[: B * T].view(B, T).numpy()
        ids_np.fill(0)  # right padding: causal attention never reads these positions
        for b, r in enumerate(rows):
            ids_np[b, : len(r.input_ids)] = r.input_ids
        hv = host[: B * T * slots * hidden].view(B, T, slots, hidden)
        if on_cuda:
            ids = ids_host[: B * T].view(B, T).to(device, non_blocking=True)
            states = cap.capture_into(ids, out=torch.empty((B, T, slots, hidden), dtype=store_dtype,
                                                           device=device))
            # one reduction instead of a full-size isfinite mask; non-finite -> checked per sample
            finite = torch.isfinite(states.sum(dtype=torch.float32))
            copy_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(copy_stream):
                hv.copy_(states, non_blocking=True)
                flag_host.copy_(finite, non_blocking=True)  # pinned: a pageable target would block
                finite_host = flag_host
                event = torch.cuda.Event()
                event.record(copy_stream)
            states.record_stream(copy_stream)
            finite.record_stream(copy_stream)
        else:
            cap.capture_into(torch.from_numpy(ids_np.copy()), out=hv)  # hooks write into the host buffer
            event, finite_host = None, None
        items = [ShardItem(r.index, r.input_ids, r.loss_mask, hv[b, : len(r.input_ids)])
                 for b, r in enumerate(rows)]

        def before(event=event, finite_host=finite_host, items=items) -> None:
            if event is not None:
                event.synchronize()
            if finite_host is None or not bool(finite_host):
                for it in items:
                    check_finite(it.states, it.index)

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


@checked("extract")
def run_extract(target: str, data: str | Path, out: str | Path, layers: list[int] | None = None,
                backend: str = "hf", dtype: str = "bf16", device: str = "auto",
                batch_tokens: int | None = None, writers: int | None = None,
                model_dtype: str | None = None, progress: bool = True,
                vllm_python: str | None = None, tensor_parallel_size: int = 1,
                data_parallel_size: int = 1, self_check: int = 8) -> dict[str, Any]:
    """Fill (or finish) the store at ``out``; returns the summary (tokens, bytes, tokens/s).

    ``self_check``: on a vLLM backend with an untested vLLM version, first compare that many
    samples' states with hf's and stop on a mismatch (eyas.extract.selfcheck); 0 skips it."""
    from tqdm import tqdm

    from eyas.data.dataset import open_prepared
    from eyas.target import resolve_target

    if dtype not in DTYPES:
        raise EyasError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    if model_dtype is not None and model_dtype not in DTYPES:
        raise EyasError(f"--model-dtype {model_dtype!r}: use one of {sorted(DTYPES)}")
    requested = backend
    backend, why, vllm_version = resolve_auto_backend(backend, vllm_python)
    if why and progress:
        print(f"eyas extract: backend {why}", file=sys.stderr, flush=True)
    fill = _load_backend(backend)
    tgt = resolve_target(target)
    ds = open_prepared(data, tgt)
    cfg = tgt.config()
    text_cfg = cfg.get("text_config", cfg)
    aux, final_id = resolve_layers(int(text_cfg["num_hidden_layers"]), layers)
    device = resolve_device(device)
    on_cuda = device.startswith("cuda")
    batch_tokens = int(batch_tokens or (65536 if on_cuda else 4096))
    # On CUDA the disk side is the bottleneck (4.6 kB/token): 16 writers beat 8 on the H200 host.
    writers = int(writers or (min(16, os.cpu_count() or 16) if on_cuda else 2))
    fields = {
        "target": tgt.identity, "aux_layers": aux, "final_layer": final_id,
        "convention": CONVENTION, "dtype": dtype, "hidden_size": int(text_cfg["hidden_size"]),
        "prepared_id": ds.manifest.get("id"), "prepared_path": str(Path(data).resolve()),
        "num_samples": len(ds), "backend": backend, "plan": {"batch_tokens": batch_tokens},
    }
    writer = StoreWriter(out, fields, shard_tokens=batch_tokens, num_writers=writers,
                         max_pending=writers + 1)
    for bad in writer.rewritten:
        print(f"eyas extract: {out}: stored shard {bad} failed its checksum and is extracted again",
              file=sys.stderr, flush=True)
    todo = [i for i in range(len(ds)) if i not in writer.done]
    checked_first = None
    if self_check and todo and vllm_version is not None:
        from eyas.extract.backends import vllm_tested
        from eyas.extract.selfcheck import self_check as run_self_check

        status = vllm_tested(vllm_version, backend)
        if not status.tested:
            try:
                checked_first = run_self_check(target, tgt, ds, todo, self_check, backend, Path(out), aux,
                                               device, model_dtype, vllm_python, tensor_parallel_size,
                                               status.note)
            except BaseException:
                writer.abort()
                raise
    total = int(ds.lengths[todo].sum()) if todo else 0
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"extract ({backend}, {device})",
               disable=not progress, smoothing=0.1)
    start = time.perf_counter()
    writer.on_commit = lambda rec: bar.update(rec["tokens"])
    job = ExtractJob(target=tgt, dataset=ds, todo=todo, writer=writer, aux_layers=aux,
                     final_layer=final_id, dtype=dtype, device=device, batch_tokens=batch_tokens,
                     options={"writers": writers, "model_dtype": model_dtype,
                              "vllm_python": vllm_python, "vllm_requested": requested,
                              "tensor_parallel_size": tensor_parallel_size,
                              "data_parallel_size": data_parallel_size})
    try:
        fill(job)
        manifest = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - job.stats.get("t_first_batch", start)
    if not manifest["complete"]:
        missing = sorted(set(range(len(ds))) - writer.done)
        raise EyasError(f"store {out}: backend {backend!r} left {len(missing)} samples unstored "
                        f"(first {missing[:5]}); re-run to finish")
    tokens = writer.tokens_written
    return {"tokens": tokens, "bytes": writer.bytes_written,
            "bytes_per_token": writer.bytes_written / tokens if tokens else 0.0,
            "seconds": elapsed, "tokens_per_s": tokens / elapsed if tokens and elapsed else 0.0,
            "store_tokens": manifest["tokens"], "samples": len(ds), "resumed_from": len(ds) - len(todo),
            "self_check": checked_first}


def register(app: typer.Typer) -> None:
    @app.command()
    def extract(
        target: str = typer.Option("smollm2-135m-instruct", help="HF dir, .gguf file or built-in name."),
        data: Path = typer.Option(None, help="Prepared dataset directory (from `eyas prepare`)."),
        out: Path = typer.Option(None, help="Store directory to create or resume."),
        layers: str = typer.Option(None, help="Aux layer ids (vLLM convention), e.g. 2,15,27; "
                                   "default 2,N/2,N-3. The final state (id N) is always stored."),
        backend: str = typer.Option("hf", help=f"Extraction backend: {', '.join(BACKENDS)}, or auto "
                                    "(by the installed vLLM version; hf without vLLM)."),
        dtype: str = typer.Option("bf16", help="Stored dtype: bf16, fp16 or fp32."),
        device: str = typer.Option("auto", help="cuda, cuda:N, cpu, or auto."),
        batch_tokens: int = typer.Option(0, help="Padded tokens per batch (= per shard); 0 = auto."),
        writers: int = typer.Option(0, help="Shard writer threads; 0 = auto."),
        model_dtype: str = typer.Option(None, help="Compute dtype; default bf16 on CUDA, fp32 on CPU."),
        verify: Path = typer.Option(None, "--verify", help="Only re-check an existing store and exit."),
        against: Path = typer.Option(None, "--against", help="With --verify: also compare its states "
                                     "with this reference store of the same data (e.g. made with "
                                     "--backend hf), token by token; prints a JSON report on stdout."),
        min_cosine: float = typer.Option(0.99, "--min-cosine", help="With --against: the cosine every "
                                         "token of every slot must reach."),
        vllm_python: str = typer.Option(None, "--vllm-python", help="Python of the environment that "
                                        "runs vLLM (default: this one, $EYAS_VLLM_PYTHON, or .venvs/vllm-*)."),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="vLLM tensor parallelism."),
        data_parallel_size: int = typer.Option(1, "--data-parallel-size", help="Number of vLLM engines, "
                                               "each over its own shard of the data."),
        self_check: int = typer.Option(8, "--self-check", help="With a vLLM backend on a vLLM version "
                                       "eyas has not tested: first extract this many samples with it and "
                                       "with hf and stop if their states differ; 0 skips the check."),
    ) -> None:
        """Run the target over a prepared dataset and store aux + final hidden states."""
        from rich.console import Console

        console = Console(stderr=True)
        if verify is not None:
            problems = verify_store(verify, progress=True)
            for p in problems:
                console.print(f"[red]problem:[/red] {p}")
            if problems:
                raise typer.Exit(1)
            console.print(f"store {verify}: all shards, checksums and shapes OK")
            if against is not None:
                import json

                from eyas.device import resolve_device
                from eyas.extract.compare import compare_stores

                rep = compare_stores(verify, against, min_cosine, device=resolve_device("auto"))
                for sl in rep["slots"]:
                    console.print(f"  {sl['slot']}: min cosine {sl['min_cosine']:.5f} (sample "
                                  f"{sl['worst_sample']}, token {sl['worst_token']}), mean "
                                  f"{sl['mean_cosine']:.6f}, {sl['tokens_below']} tokens below {min_cosine}")
                verdict = "every token" if rep["ok"] else f"{rep['rows_below']} samples have tokens"
                console.print(f"against {against}: {rep['samples']} samples, {rep['tokens']:,} tokens; "
                              f"{verdict} {'at or above' if rep['ok'] else 'below'} cosine {min_cosine}")
                typer.echo(json.dumps(rep))
                if not rep["ok"]:
                    raise typer.Exit(1)
            return
        if data is None or out is None:
            raise EyasError("eyas extract needs --data PREPARED_DIR and --out STORE (or --verify STORE)")
        s = run_extract(target, data, out, parse_layers(layers), backend=backend, dtype=dtype,
                        device=device, batch_tokens=batch_tokens or None, writers=writers or None,
                        model_dtype=model_dtype, vllm_python=vllm_python,
                        tensor_parallel_size=tensor_parallel_size,
                        data_parallel_size=data_parallel_size, self_check=self_check)
        console.print(f"stored {s['samples']} samples ({s['resumed_from']} were already there): "
                      f"{s['tokens']:,} tokens this run, {s['bytes'] / 1e9:.3f} GB, "
                      f"{s['bytes_per_token']:.0f} B/token, {s['seconds']:.1f} s, "
                      f"{s['tokens_per_s']:,.0f} tokens/s -> {out}")
