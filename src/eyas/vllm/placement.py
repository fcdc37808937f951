"""Where an engine child runs: the GPUs eyas may hand out, and a share of the cores for a CPU build."""

from __future__ import annotations

import os


def visible_gpus() -> list[str]:
    """The GPU ids this process may use, as CUDA_VISIBLE_DEVICES names them (all GPUs when unset)."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def cpu_share(k: int, n: int) -> str:
    """Engine k of n's cores, for VLLM_CPU_OMP_THREADS_BIND: n CPU engines must not share threads."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)
    return ",".join(map(str, cores[k * per : (k + 1) * per] or cores[-per:]))
