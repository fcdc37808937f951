"""Keep a draft that `eyas pipeline` trained on the device (`gpu_job.sh pipeline`, e.g. `sampled.sh`)
as the recipe sweeps' drafts are kept: a line of ``results-DATE.jsonl`` and its replay reports under
``evals/NAME/`` (without the answers' token ids), so that `to_summary.py` and `paired.py` take it.

    python benchmarks/recipe/keep_pipeline.py NAME PIPELINE_TGZ [--humaneval EVAL_TGZ] \\
        --commit HASH --machine "1x NVIDIA H100 80GB HBM3 (lent)" [--date 2026-12-06] [--note TEXT]

PIPELINE_TGZ is the call's ``pipeline.tgz`` of the run's last call (its ``eval/`` holds MT-bench at
each k); EVAL_TGZ is `humaneval.sh`'s ``eval-humaneval.tgz``. Tau while training, where the run
measured it (``train.tau_every``), is kept as ``evals/NAME/tau_curve.jsonl`` for `budget_curve.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tarfile
import tempfile
from pathlib import Path

from keep_evals import keep_report
from results import runs

HERE = Path(__file__).resolve().parent
SUBS = {5: "replay", 3: "k3/replay", 7: "k7/replay"}


def keep_reports(src: Path, dst: Path) -> dict[str, dict]:
    """Copy every k's report from ``src`` (an `eyas evaluate --out` folder) to ``dst``; tau per k."""
    taus = {}
    for k, sub in SUBS.items():
        rep_path = src / sub / "report.json"
        if not rep_path.is_file():
            continue
        rep = keep_report(rep_path, dst / sub / "report.json")
        taus[str(k)] = {"tau": rep["overall"]["tau"], "turns": len(rep["per_prompt"])}
    if not taus:
        raise SystemExit(f"{src}: no report.json under {', '.join(SUBS.values())}")
    return dict(sorted(taus.items()))


def row(name: str, run: Path, taus: dict, a: argparse.Namespace) -> dict:
    summary = json.loads((run / "train/summary.json").read_text())
    config = json.loads((run / "pipeline-config.json").read_text())["sections"]
    manifest = json.loads((run / "prepared/manifest.json").read_text())
    metrics = [json.loads(x) for x in (run / "train/metrics.jsonl").read_text().splitlines() if x]
    steps = [m for m in metrics if m.get("split") == "train"]
    train = config.get("train", {})
    regen = manifest.get("regenerate") or {}
    return {
        "name": name,
        "args": "eyas train's CUDA defaults" + (f" --seed {train['seed']}" if train.get("seed") else ""),
        "data": f"{Path(summary['draft']).parents[1]}/prepared",
        "conversations": manifest["counts"]["samples"],
        # conversations kept without their leading assistant messages (--leading-assistant trim)
        "trimmed_leading_assistant": manifest["counts"].get("trimmed_leading_assistant", 0),
        "regenerate": {
            **regen.get("settings", {}),
            "answers": regen.get("answers"),
            "length_limited": regen.get("length_limited"),
            "loop_tokens_masked": manifest["counts"].get("loop_tokens"),
        },
        "common": " ".join(f"{k}={json.dumps(v)}" for k, v in train.items()),
        "how": f"eyas pipeline, sections {json.dumps(config)}",
        "budget_s": summary["budget_s"],
        "steps": summary["steps"],
        "steps_s": summary["steps_s"],
        "first_step_s": steps[0]["elapsed_s"] if steps else None,
        "epochs": summary["epochs"],
        "tokens_seen": summary["tokens_seen"],
        "final_loss": steps[-1]["loss"] if steps else None,
        "finite": bool(steps) and all(m.get("finite", True) for m in steps),
        "tau": taus,
        "train_tau": summary.get("tau"),
        "max_new_tokens": config.get("evaluate", {}).get("max_new_tokens"),
        "commit": a.commit,
        "date": a.date,
        "machine": a.machine,
        **({"note": a.note} if a.note else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("pipeline_tgz", type=Path)
    ap.add_argument("--humaneval", type=Path, help="humaneval.sh's eval-humaneval.tgz")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--note", default="")
    ap.add_argument("--results", type=Path, help="default: results-DATE.jsonl here")
    a = ap.parse_args(argv)
    if any(run["name"] == a.name for _, run in runs()):
        raise SystemExit(f"{a.name}: a results line of that name exists already; choose another name")
    keep = HERE / "evals" / a.name
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        with tarfile.open(a.pipeline_tgz) as t:
            t.extractall(run, filter="data")
        taus = {"mt_bench": keep_reports(run / "eval", keep / "eval-mt_bench")}
        if a.humaneval:
            he = Path(tmp) / "he"
            with tarfile.open(a.humaneval) as t:
                t.extractall(he, filter="data")
            taus["humaneval"] = keep_reports(next(he.iterdir()), keep / "eval-humaneval")
        line = row(a.name, run, taus, a)
        metrics = (run / "train/metrics.jsonl").read_text().splitlines()
        curve = [x for x in metrics if x and json.loads(x).get("split") == "tau"]
        if curve:
            (keep / "tau_curve.jsonl").write_text("\n".join(curve) + "\n")
    results = a.results or HERE / f"results-{a.date}.jsonl"
    with open(results, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"{a.name}: {json.dumps(taus)} -> {results.name}, evals/{a.name}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
