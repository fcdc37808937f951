"""eyas touches vLLM only through its supported surface (an allow-list, checked on the AST).

Every module under src/eyas is parsed; each import of ``vllm`` or ``vllm.*`` (module level or
inside functions) must be on the allow-list below. The engine-side package must, in addition,
import only the standard library, torch, numpy, safetensors, transformers (version check)
and vLLM, and itself only relatively, since it runs inside a vLLM environment without eyas.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_envs import version_key, versions, vllm_python

SRC = Path(__file__).resolve().parents[1] / "src" / "eyas"
WORKER = SRC / "vllm" / "worker"

# module -> names that may be imported from it (None: `import module` itself)
ALLOWED_VLLM: dict[str, set[str | None]] = {
    # EngineArgs: only its dataclass fields are read, to detect options a version has
    "vllm": {None, "LLM", "SamplingParams", "EngineArgs", "__version__"},
    # the dataclass behind --speculative-config (vLLM's config reference documents it): only its
    # fields are read, to name the keys a version takes when --speculative-options has another
    "vllm.config": {"SpeculativeConfig", "ProfilerConfig"},
    # ProfilerConfig, the dataclass behind --profiler-config (also documented): only its fields are
    # read, to leave Python stacks out of a profile where a version can
    # the type of SamplingParams' documented output_kind field (regeneration asks for FINAL_ONLY)
    "vllm.sampling_params": {"RequestOutputKind"},
    # the stock hidden-states connector we subclass for CPU, and its public file helpers
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector": {
        "ExampleHiddenStatesConnector",
        "extract_from_kv_cache",
        "load_hidden_states",
        "cleanup_hidden_states",
    },
}
WORKER_THIRD_PARTY = {"torch", "numpy", "safetensors", "transformers", "vllm"}


def vllm_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every import of vllm or a vllm submodule in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "vllm"]
        elif (
            isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "vllm"
        ):
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def violations(source: str) -> list[str]:
    bad = []
    for line, mod, name in vllm_imports(source):
        allowed = ALLOWED_VLLM.get(mod)
        if allowed is None or name not in allowed:
            bad.append(f"line {line}: {mod}" + (f".{name}" if name else ""))
    return bad


def worker_violations(source: str) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(source)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [node.module or ""]
        for m in mods:
            root = m.split(".")[0]
            if root not in sys.stdlib_module_names and root not in WORKER_THIRD_PARTY:
                bad.append(f"line {node.lineno}: {m}")
    return bad


def eyas_modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_eyas_module_uses_only_allowed_vllm_imports():
    problems = {str(p.relative_to(SRC)): v for p in eyas_modules() if (v := violations(p.read_text()))}
    assert not problems, f"vLLM internals imported outside the allow-list: {problems}"


def test_the_checker_catches_internals():
    src = (
        "from vllm import LLM\n"
        "def f():\n    from vllm.v1.core.sched.output import SchedulerOutput\n"
        "    import vllm.v1.request\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import PendingSave\n"
    )
    assert sorted(violations(src)) == [
        "line 3: vllm.v1.core.sched.output.SchedulerOutput",
        "line 4: vllm.v1.request",
        "line 5: vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector.PendingSave",
    ]
    assert worker_violations("import typer\nfrom eyas.errors import EyasError\nfrom . import chunks\n") == [
        "line 1: typer",
        "line 2: eyas.errors",
    ]


def test_vllm_modules_are_found():
    # guards against the scan silently looking at nothing
    users = [p.name for p in eyas_modules() if vllm_imports(p.read_text())]
    assert {"engine.py", "connector.py"} <= set(users)


def test_worker_package_needs_nothing_of_eyas():
    problems = {p.name: v for p in sorted(WORKER.glob("*.py")) if (v := worker_violations(p.read_text()))}
    assert not problems, f"engine-side modules import outside what a vLLM install has: {problems}"


@pytest.mark.vllm
@pytest.mark.parametrize("version", versions())
def test_worker_package_imports_in_the_vllm_env(version, tmp_path):
    """Copied as eyas_vllm_worker, the package imports in the bare vLLM env (connector: >= 0.18)."""
    import shutil

    py = vllm_python(version)
    shutil.copytree(WORKER, tmp_path / "eyas_vllm_worker")
    mods = ["chunks", "hooks", "engine"] + (["connector"] if version_key(version) >= (0, 18) else [])
    code = "; ".join(f"import eyas_vllm_worker.{m}" for m in mods) + "; print('ok')"
    res = subprocess.run(
        [str(py), "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
