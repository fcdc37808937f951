"""`eyas doctor`: what this machine has, and which extraction backends can run here."""

from __future__ import annotations

import platform
import sys
from typing import Any

from eyas.errors import EyasError
from eyas.extract.backends import backend_statuses, choose_vllm_backend, is_cpu_build, vllm_tested
from eyas.vllm.find import installed_vllm_version


def auto_choice() -> dict[str, Any]:
    """What ``eyas extract --backend auto`` takes here: which vLLM (the same search as extract),
    which backend, and whether that version is tested."""
    from eyas.vllm.find import find_vllm_python, probe_vllm

    try:
        python, found_by = find_vllm_python(None)
        inst = probe_vllm(python)
        cpu = inst.version is not None and is_cpu_build(inst.version, inst.dist)
        backend, why = choose_vllm_backend("auto", inst.version, where=python, cpu_build=cpu)
    except EyasError as e:
        no_vllm = "no vLLM found" in str(e)
        return {
            "backend": "hf" if no_vllm else None,
            "vllm": None,
            "tested": None,
            "why": ("hf, because " if no_vllm else "refused: ") + str(e),
        }
    st = vllm_tested(inst.version, backend)
    return {
        "backend": backend,
        "vllm": inst.version,
        "python": python,
        "found_by": found_by,
        "tested": st.tested,
        "newest_tested": st.newest_tested,
        "note": st.note,
        "why": why,
    }


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
    info["auto"] = auto_choice()
    return info
