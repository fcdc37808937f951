"""Starting the vLLM engine(s) of `eyas train --features vllm`: the interpreter and backend are found
as for `eyas extract --backend auto` (:mod:`eyas.vllm.find`, :func:`eyas.extract.vllm_backend.resolve_backend`),
the engine is ``eyas_vllm_worker.stream``, started by :class:`eyas.vllm.process.WorkerProcess`.

GPUs (designed, not yet run): with one engine of one GPU per rank, the engine shares the rank's
own GPU (``LOCAL_RANK``) and takes ``--gpu-memory-utilization`` of it; with
``--tensor-parallel-size`` x ``--data-parallel-size`` > 1, rank r's engines take the block of
GPUs after the trainer ranks' own. On the CPU, several engines split the cores.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.vllm import VLLM_DTYPES
from eyas.vllm.placement import cpu_share, visible_gpus
from eyas.vllm.process import WorkerProcess


def _dtype_name(dtype: torch.dtype) -> str:
    return {
        torch.float32: VLLM_DTYPES["fp32"],
        torch.bfloat16: VLLM_DTYPES["bf16"],
        torch.float16: VLLM_DTYPES["fp16"],
    }[dtype]


def engine_env(local_rank: int, world: int, k: int, tp: int, dp: int) -> dict[str, str]:
    """Engine ``k`` of the rank with ``local_rank``: its GPUs (CUDA) or its cores (CPU, several engines)."""
    env: dict[str, str] = {}
    if torch.cuda.is_available():
        devs = visible_gpus()
        if tp * dp == 1:
            mine = [devs[local_rank % len(devs)]]  # beside this rank's trainer
        else:
            first = world + (local_rank * dp + k) * tp  # after the trainer ranks' GPUs
            mine = devs[first : first + tp]
            if len(mine) < tp:
                raise EyasError(
                    f"--data-parallel-size {dp} x --tensor-parallel-size {tp} engines per rank for "
                    f"{world} trainer rank(s) need {world + world * dp * tp} GPUs; {len(devs)} "
                    "visible. Use 1 x 1 (the engine shares its rank's GPU) or fewer"
                )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    elif dp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_share(k, dp)
    return env


def start_engines(src, buffer: Path, work: Path) -> tuple[list[WorkerProcess], str, str]:
    """Start ``--data-parallel-size`` engines for the stream source ``src`` (an
    :class:`eyas.train.stream.StreamFeatures`); returns (engines, backend, what was chosen and why).
    They load the model in the background: the feeder waits for each one's ready reply."""
    from eyas.extract.vllm_backend import resolve_backend

    cfg = src.cfg
    backend, inst, message = resolve_backend("auto", cfg.vllm_python)
    if backend not in ("vllm", "vllm-hooks"):
        raise EyasError(f"--features vllm needs a vLLM engine; {message}")
    tp, dp = int(cfg.tensor_parallel_size), int(cfg.data_parallel_size)
    max_len = src.budget + 1  # +1: the one sampled token
    engines = []
    try:
        for k in range(dp):
            edir = work / f"engine-{k}"
            shutil.rmtree(edir, ignore_errors=True)
            edir.mkdir(parents=True)
            spec = {
                "backend": backend,
                "model": str(src.target.path),
                "dtype": _dtype_name(src.dtype),
                "aux": src.aux_layers,
                "final": src.final_layer,
                "out_dir": str(buffer),
                "raw_dir": str(buffer / f"raw-{k}"),
                "work_dir": str(edir),
                "tag": f"r{src.rank}e{k}",
                "max_model_len": max_len,
                "tensor_parallel_size": tp,
                "max_num_batched_tokens": max(max_len, 8192),
                "seed": int(cfg.seed),
                "engine_kwargs": {"gpu_memory_utilization": float(cfg.gpu_memory_utilization)},
            }
            engines.append(
                WorkerProcess(
                    inst.python,
                    "stream",
                    spec,
                    edir,
                    edir / "engine.log",
                    interactive=True,
                    multiprocessing=backend != "vllm-hooks",
                    cwd=edir,
                    env=engine_env(src.local_rank, src.world, k, tp, dp),
                    describe=f"vLLM engine {k} of rank {src.rank} ({inst.dist} {inst.version}, {backend})",
                )
            )
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines, backend, message
