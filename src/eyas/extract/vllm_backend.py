"""eyas's side of the vLLM backends (``vllm``, ``vllm-hooks``): launch engines, collect, store.

Each engine is the worker package's ``engine`` module in the vLLM interpreter (found and started by
:mod:`eyas.vllm`). Engines leave chunk files; this side checks every sample's tokens against the
prepared dataset, then writes it through the same ``StoreWriter`` as the HF backend, so the stores
are identical in format.

Resume: the store's committed samples are skipped; chunk files left by a killed run are
collected before new engines start; a chunk is deleted only once its samples are committed.
Data parallelism: ``--data-parallel-size N`` starts N engines over N shards of the remaining
samples (each with ``--tensor-parallel-size`` GPUs when on CUDA).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.vllm.placement import cpu_share, visible_gpus
from eyas.extract.backends import choose_vllm_backend, is_cpu_build
from eyas.vllm import VLLM_DTYPES
from eyas.vllm.find import VllmInstall, find_vllm_python, probe_vllm
from eyas.vllm.process import WorkerProcess
from eyas.vllm.worker.chunks import list_chunks, read_chunk


def resolve_backend(requested: str, vllm_python: str | None = None) -> tuple[str, VllmInstall, str]:
    """``auto``/``vllm``/``vllm-hooks`` -> (backend, install, message saying what and why)."""
    python, why_python = find_vllm_python(vllm_python)
    inst = probe_vllm(python)
    cpu = inst.version is not None and is_cpu_build(inst.version, inst.dist)
    backend, why = choose_vllm_backend(requested, inst.version, where=python, cpu_build=cpu)
    return backend, inst, f"{backend}: {why} (interpreter chosen by {why_python})"


# ----------------------------------------------------------------------- launching


def _write_prompts(path: Path, dataset, indices: list[int]) -> None:
    seqs = [np.asarray(dataset[i].input_ids, dtype=np.int64) for i in indices]
    off = np.zeros(len(seqs) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.concatenate(seqs).astype(np.int32) if seqs else np.zeros(0, np.int32)
    np.savez(path, indices=np.asarray(indices, dtype=np.int64), offsets=off, flat=flat)


def _shards(indices: list[int], lengths: np.ndarray, n: int) -> list[list[int]]:
    """Split into n shards of about equal tokens (greedy over lengths, longest first)."""
    order = sorted(indices, key=lambda i: -int(lengths[i]))
    shards: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in order:
        k = load.index(min(load))
        shards[k].append(i)
        load[k] += int(lengths[i])
    return [sorted(s, key=lambda i: -int(lengths[i])) for s in shards if s]


def _device_env(rank: int, tp: int, dp: int) -> dict[str, str]:
    """Give engine ``rank`` its own GPUs (CUDA) or its own cores (CPU build, dp > 1)."""
    env: dict[str, str] = {}
    if torch.cuda.is_available():
        devs = visible_gpus()
        mine = devs[rank * tp : (rank + 1) * tp]
        if len(mine) < tp:
            raise EyasError(
                f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs {dp * tp} GPUs; {len(devs)} visible"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    elif dp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_share(rank, dp)
    return env


# ----------------------------------------------------------------------- collecting


def _engine_aux(job) -> list[int]:
    """The aux ids the engine is asked for. Fault injection for the self-check's test:
    ``$EYAS_FAULT_VLLM_AUX_SHIFT=K`` asks for layers K further on and stores them under the
    requested ids, i.e. a backend with a layer off-by-K."""
    shift = int(os.environ.get("EYAS_FAULT_VLLM_AUX_SHIFT") or 0)
    return [min(a + shift, job.final_layer - 1) for a in job.aux_layers]


def _collect(job, chunk_dir: Path, final_id: int) -> int:
    """Move every finished chunk in ``chunk_dir`` into the store; returns samples added."""
    added = 0
    ds, writer = job.dataset, job.writer
    want = [*_engine_aux(job), final_id]
    for path in list_chunks(chunk_dir):
        meta, samples = read_chunk(path)
        if meta.get("aux") is not None and [*meta["aux"], meta["final"]] != want:
            raise EyasError(
                f"{path}: states of layers {meta['aux']}+{meta['final']}, this store wants "
                f"{want}; delete {chunk_dir} (left by a run with other --layers)"
            )
        for index, ids, states in samples:
            if index in writer.done:
                continue  # already stored (a chunk committed just before a kill, not yet deleted)
            sample = ds[index]
            if not np.array_equal(ids.numpy(), np.asarray(sample.input_ids, dtype=np.int64)):
                raise EyasError(
                    f"{path}: states for sample {index} were computed from other tokens "
                    "than the prepared dataset holds; refusing to store them"
                )
            if states.shape[1] != len(want):
                raise EyasError(f"{path}: sample {index} has {states.shape[1]} states per token, expected {len(want)}")
            writer.add(index, sample.input_ids, sample.loss_mask, states[:, :-1], states[:, -1])
            added += 1
        writer.flush()
        writer.wait()  # committed: only now is the chunk redundant
        path.unlink()
    return added


def fill_vllm_any(job, backend: str) -> None:
    opts = job.options
    requested = opts.get("vllm_requested", backend)
    resolved, inst, message = resolve_backend(requested, opts.get("vllm_python"))
    if resolved != backend:
        raise EyasError(f"backend {backend} was asked for but {message}")
    print(f"eyas extract: {message}", file=sys.stderr, flush=True)
    # absolute: the engine runs with its own cwd, and this path is on its PYTHONPATH
    work = Path(job.writer.path).resolve() / ".vllm-work"
    chunk_dir = work / "chunks"
    final_id = job.final_layer
    job.stats["t_first_batch"] = time.perf_counter()
    _collect(job, chunk_dir, final_id)  # left over by a killed run
    todo = [i for i in job.todo if i not in job.writer.done]
    if not todo:
        return
    tp = int(opts.get("tensor_parallel_size") or 1)
    dp = int(opts.get("data_parallel_size") or 1)
    lengths = job.dataset.lengths
    model_dtype = opts.get("model_dtype")
    max_len = int(max(lengths[i] for i in todo)) + 1  # +1: the one sampled token
    engines: list[WorkerProcess] = []
    shards = _shards(todo, lengths, dp)
    try:
        for rank, shard in enumerate(shards):
            edir = work / f"engine-{rank}"
            shutil.rmtree(edir, ignore_errors=True)
            edir.mkdir(parents=True)
            _write_prompts(edir / "prompts.npz", job.dataset, shard)
            spec = {
                "backend": backend,
                "model": str(job.target.path),
                "dtype": VLLM_DTYPES.get(model_dtype, "auto") if model_dtype else "auto",
                "aux": _engine_aux(job),
                "final": final_id,
                "prompts": str(edir / "prompts.npz"),
                "out_dir": str(chunk_dir),
                "work_dir": str(edir),
                "tag": f"{rank}-{int(time.time())}",
                "max_model_len": max_len,
                "tensor_parallel_size": tp,
                "batch_tokens": int(job.batch_tokens),
                "max_num_batched_tokens": max(max_len, 8192),
                "engine_kwargs": opts.get("engine_kwargs") or {},
            }
            # the hooks backend needs no engine-core process of its own (faster start); the
            # connector does, because its files are written in engine steps after the requests returned
            engines.append(
                WorkerProcess(
                    inst.python,
                    "engine",
                    spec,
                    edir,
                    edir / "engine.log",
                    interactive=False,
                    multiprocessing=backend != "vllm-hooks",
                    cwd=edir,
                    env=_device_env(rank, tp, len(shards)),
                )
            )
        while True:
            codes = [e.poll() for e in engines]
            _collect(job, chunk_dir, final_id)
            bad = [(r, e, c) for r, (e, c) in enumerate(zip(engines, codes)) if c not in (None, 0)]
            if bad:
                r, e, c = bad[0]
                raise EyasError(
                    f"vLLM engine {r} ({inst.dist} {inst.version}, {backend}) exited "
                    f"with code {c}; its log is {e.log_path}:\n{e.failure()}"
                )
            if all(c == 0 for c in codes):
                break
            time.sleep(0.5)
        _collect(job, chunk_dir, final_id)
    finally:
        for e in engines:
            e.stop()
    missing = [i for i in todo if i not in job.writer.done]
    if missing:
        raise EyasError(
            f"vLLM ({backend}) finished but {len(missing)} samples were not stored (first "
            f"{missing[:5]}); see the logs in {work}; re-run to retry them"
        )
    # keep the engine logs (timings, vLLM's own messages) beside the store; drop the rest
    logs = Path(job.writer.path) / ".vllm-logs"
    logs.mkdir(exist_ok=True)
    for rank, e in enumerate(engines):
        shutil.copy(e.log_path, logs / f"engine-{rank}.log")
    shutil.rmtree(work, ignore_errors=True)


def engine_timings(store: str | Path) -> list[dict[str, Any]]:
    """Per engine: vLLM version, start-up seconds, and the prefill loop's tokens and seconds."""
    out = []
    for log in sorted((Path(store) / ".vllm-logs").glob("engine-*.log")):
        rec: dict[str, Any] = {"log": str(log)}
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"eyas": '):
                ev = json.loads(line)
                if ev["eyas"] == "engine-ready":
                    rec.update(vllm=ev["vllm"], startup_s=ev["seconds"])
                elif ev["eyas"] == "done":
                    rec.update(tokens=ev["tokens"], loop_s=ev["seconds"])
        out.append(rec)
    return out


def fill_vllm(job) -> None:
    """Backend ``vllm``: extract_hidden_states + eyas's connector (vLLM >= 0.18)."""
    fill_vllm_any(job, "vllm")


def fill_vllm_hooks(job) -> None:
    """Backend ``vllm-hooks``: worker extension + forward hooks (vLLM 0.12-0.17)."""
    fill_vllm_any(job, "vllm-hooks")
