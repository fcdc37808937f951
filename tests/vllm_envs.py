"""The vLLM environments tests run against (.venvs/vllm-VERSION, made by scripts/setup_vllm_env.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def vllm_python(version: str) -> str:
    """That environment's python, or skip the test when it is absent or was never finished."""
    py = ROOT / ".venvs" / f"vllm-{version}" / "bin" / "python"
    if not (py.is_file() and (py.parent.parent / ".eyas-ready").is_file()):
        pytest.skip(f"no ready vLLM env at {py.parent.parent}: run scripts/setup_vllm_env.sh {version} "
                    f"to test vLLM {version}")
    return str(py)
