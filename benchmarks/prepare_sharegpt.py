"""Benchmark: `eyas prepare` on all 17,671 complete ShareGPT conversations for SmolLM2-135M-Instruct.

Runs the real CLI in a subprocess (fresh output dir each time) for each --workers value and
records wall clock, the child's CPU seconds (user+sys, less sensitive to other load), the
stage's own time from the manifest, the counts, and `uptime` load before and after, because
other engineers share this machine's CPU. Results are appended as JSON lines to
benchmarks/prepare_sharegpt.results.jsonl.

    .venv/bin/python benchmarks/prepare_sharegpt.py --workers 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _commit() -> str:
    res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src/eyas/data"], capture_output=True, text=True, cwd=HERE.parent
    ).stdout.strip()
    return res.stdout.strip() + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_once(workers: int, target: str, data: str, max_samples: int | None, root: Path) -> dict:
    out = root / f"prepared-w{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "eyas.cli",
        "prepare",
        "--target",
        target,
        "--data",
        data,
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--quiet",
    ]
    if max_samples:
        cmd += ["--max-samples", str(max_samples)]
    before = _uptime()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    after = _uptime()
    if res.returncode != 0:
        raise SystemExit(f"prepare failed ({res.returncode}):\n{res.stderr[-3000:]}")
    m = json.loads((out / "manifest.json").read_text())
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {_cpu_model()}",
        "command": " ".join(cmd[1:]),
        "eyas_commit": _commit(),
        "workers": workers,
        "wall_s": round(wall, 2),
        "child_cpu_s": round((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), 2),
        "stage_s": m["seconds"],
        "read": m["counts"]["read"],
        "samples": m["counts"]["samples"],
        "dropped": m["counts"]["dropped"],
        "tokens": m["counts"]["tokens"],
        "trained_tokens": m["counts"]["trained_tokens"],
        "coverage": round(m["coverage"], 5),
        "truncated_source": bool(m["sources"][0].get("truncated")),
        "uptime_before": before,
        "uptime_after": after,
        "summary": res.stderr.strip().splitlines()[-12:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2", help="comma-separated --workers values to time")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--results", default=str(HERE / "prepare_sharegpt.results.jsonl"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eyas-bench-prepare-") as tmp:
        for w in [int(x) for x in args.workers.split(",")]:
            r = run_once(w, args.target, args.data, args.max_samples, Path(tmp))
            with open(args.results, "a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(
                f"workers={w}: wall {r['wall_s']} s, child CPU {r['child_cpu_s']} s, stage "
                f"{r['stage_s']} s, read {r['read']}, kept {r['samples']}, trained tokens "
                f"{r['trained_tokens']:,}; load before: {r['uptime_before'].split('load average:')[-1]}"
                f", after: {r['uptime_after'].split('load average:')[-1]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
