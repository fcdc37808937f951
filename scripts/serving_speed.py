"""Record the serving speed `eyas evaluate --engine vllm --speed-concurrency ...` measured in
benchmarks/serving_speed.json: one row per target, k and concurrency (output tokens/s with and
without the draft, and their ratio), the best k per target and concurrency, and what each target's
run was (draft, vLLM, machine, prompts, the minimum waves and seconds per point).

The rows are copied from each evaluation's OUT/vllm/report.json (its ``serving_speed_by_k`` and
``best_k``); nothing is measured here. A run cut short before its summary (a time limit between two
k) still counts for the k it finished: their reports (OUT/vllm/ and OUT/k<N>/vllm/) are put side by
side the way `eyas evaluate` would have, and the run is marked ``partial`` with the k it has. A
target already in the file is replaced by the new run.

    python scripts/serving_speed.py EVAL_DIR [EVAL_DIR ...]          # into benchmarks/serving_speed.json
    python scripts/serving_speed.py --out FILE EVAL_DIR [EVAL_DIR ...]
    python scripts/serving_speed.py --gpu "NVIDIA H100 80GB HBM3" EVAL_DIR   # a report without its GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eyas.evaluate.report import finished_summary, recommended_k

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "serving_speed.json"
WHAT = (
    "vLLM output tokens/s with and without the draft, per target, k and number of concurrent requests; "
    "the rows of `eyas evaluate --engine vllm --speed-concurrency ... -k K --also-k ...` (OUT/vllm/report.json)"
)


def run_of(eval_dir: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(target, rows, best k, what the run was) of one evaluation."""
    path = Path(eval_dir) / "vllm" / "report.json"
    rep = json.loads(path.read_text())
    # rebuilt from each k's own report: a run cut between two k, and the rows of reports written
    # before each row carried its k's host probe ratio
    rebuilt, measured = finished_summary(rep, Path(eval_dir))
    partial = None if rep.get("serving_speed_by_k") else measured
    rep = rebuilt if rebuilt.get("serving_speed_by_k") else rep
    if not rep.get("serving_speed_by_k"):
        sys.exit(f"{path}: no serving speed; evaluate with --engine vllm --speed-concurrency 1,8,32")
    target = rep.get("target_name") or rep["target"]["id"]
    speed = rep["serving_speed"]
    run = {
        "report": str(path),
        "draft": rep.get("draft"),
        "draft_sha256": rep.get("draft_sha256"),
        "target_id": (rep.get("target") or {}).get("id"),
        "vllm": rep.get("vllm_version"),
        "machine": rep.get("machine"),
        "gpu": rep.get("gpu"),
        "dtype": rep.get("dtype"),
        "created": rep.get("created"),
        "prompts": rep.get("prompts"),
        "first_turns": speed.get("prompts"),
        "max_new_tokens": speed.get("max_new_tokens"),
        "min_waves": speed.get("min_waves"),
        "min_seconds": speed.get("min_seconds"),
        "tau_by_k": rep.get("tau_by_k"),
        # each k's decoding step part by part at 1 request (--speed-profile-steps), where measured
        **({"step_profile": rep["step_profile"]} if rep.get("step_profile") else {}),
        **({"partial": {"k_measured": partial}} if partial else {}),
    }
    rows = [{"target": target, **r} for r in rep["serving_speed_by_k"]]
    return target, rows, rep.get("best_k") or {}, run


def merge(table: dict[str, Any], eval_dirs: list[Path], gpu: str | None = None) -> dict[str, Any]:
    rows, best, runs = list(table.get("rows", [])), dict(table.get("best_k", {})), dict(table.get("runs", {}))
    recommended = dict(table.get("recommended_k", {}))
    for d in eval_dirs:
        target, new, b, run = run_of(d)
        if gpu and run["gpu"] and gpu != run["gpu"]:
            sys.exit(f"--gpu {gpu!r}: {d}'s report says its engine ran on {run['gpu']!r}; leave --gpu out")
        run["gpu"] = run["gpu"] or gpu
        rows = [r for r in rows if r["target"] != target] + new
        best[target], runs[target] = b, run
        # the k to serve with, from the rows (reports written before eyas named it have none)
        rec = recommended_k(new)
        recommended.pop(target, None)
        if rec:
            recommended[target] = rec
    rows.sort(key=lambda r: (r["target"], r["concurrency"], r["k"]))
    return {"what": WHAT, "rows": rows, "best_k": best, "recommended_k": recommended, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_dirs", nargs="+", type=Path, help="OUT of `eyas evaluate` (holds vllm/report.json)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--gpu", help="the GPU the run was timed on, for a report written before evaluate recorded it")
    args = ap.parse_args(argv)
    table = json.loads(args.out.read_text()) if args.out.is_file() else {}
    args.out.write_text(json.dumps(merge(table, args.eval_dirs, args.gpu), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
