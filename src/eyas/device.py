"""`--device` resolution shared by every stage that runs the target."""

from __future__ import annotations

import re

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
