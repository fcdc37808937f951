"""`--device` resolution shared by every stage that runs the target."""

from __future__ import annotations

import gc
import re
import sys

from eyas.errors import EyasError

DEVICE_FORM = re.compile(r"(auto|cpu|cuda(:\d+)?)")


def resolve_device(device: str, flag: str = "--device") -> str:
    """'auto' -> cuda when available, else cpu; refuses any other spelling than auto, cpu, cuda and
    cuda:N, and cuda (or a cuda:N past the last GPU) on a machine without it. No model is touched."""
    import torch

    text = str(device).strip()
    if not DEVICE_FORM.fullmatch(text):
        raise EyasError(f"{flag} {device!r}: choose auto (cuda when there is a GPU, else cpu), cpu, cuda or cuda:N")
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EyasError(f"{flag} {text}: CUDA is not available here; use {flag} cpu or auto")
        n = torch.cuda.device_count()
        if ":" in text and int(text.split(":")[1]) >= n:
            raise EyasError(f"{flag} {text}: this machine has {n} GPU(s) (cuda:0 .. cuda:{n - 1})")
    return text


def device_name(device: str) -> str:
    """What the pace of a step depends on, for a record to compare across machines: the GPU's name,
    or the CPU with the threads torch uses."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu, {torch.get_num_threads()} threads"


def release_device_memory() -> None:
    """Return what a finished stage left in torch's CUDA cache to the driver: a vLLM engine that a
    later stage starts runs in its own process and sees only the driver's free memory, so the
    training's cached blocks would make it refuse to start (below its gpu_memory_utilization)."""
    gc.collect()  # the stage's modules and tensors, where only reference cycles still hold them
    torch = sys.modules.get("torch")  # a stage that never imported torch holds no device memory
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
