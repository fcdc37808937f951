"""`--device` resolution shared by every stage that runs the target."""

from __future__ import annotations

from eyas.errors import EyasError


def resolve_device(device: str) -> str:
    """'auto' -> cuda when available, else cpu; refuses cuda on a machine without it."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EyasError(f"--device {device}: CUDA is not available here; use --device cpu or auto")
    return device
