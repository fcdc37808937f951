"""`eyas doctor`: what this machine has, and which extraction backends can run here."""

from __future__ import annotations

import platform
import sys
from typing import Any

from eyas.extract.backends import backend_statuses
from eyas.vllm.find import installed_vllm_version


def collect() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": installed_vllm_version(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB")
    else:
        info["devices"].append(f"cpu ({torch.get_num_threads()} threads)")
    info["backends"] = [vars(s) for s in backend_statuses(info["vllm"])]
    return info
