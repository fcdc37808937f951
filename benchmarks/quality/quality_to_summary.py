"""Put every draft of a quality comparison (run_quality.py) into benchmarks/quality/summary.json.

RUN is a folder with the comparison's ``results.json`` and its work files (``gpu_job.sh quality``'s
``quality.tgz`` unpacked beside it). Every checkpoint of both curves becomes one row per prompt set
and k, named ``TAG-eyas-<seconds>s`` / ``TAG-speculators-<seconds>s`` after its seconds of training,
its tau with a 95% bootstrap CI over questions. Re-running replaces those rows:

    python benchmarks/quality/quality_to_summary.py RUN --tag quality-2026-12-05 [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from add_summary import entry, read_records, upsert  # noqa: E402


def rows(run: Path, tag: str) -> list[dict]:
    res = json.loads((run / "results.json").read_text())
    main = next((v for k, v in res["args"].items() if k.startswith("main")), {})
    # a converted target's folder is named for it, as the other rows name it
    target = Path(json.loads((run / "prep_regen" / "manifest.json").read_text())["target_spec"]).name
    samples = res["data"]["regenerated"]["counts"]["samples"]
    ev = next((v for k, v in res["args"].items() if k.startswith("rest")), main)  # the evaluations' settings
    rest = res.get("started", {}).get("rest", "?")
    how = {"eyas": f"eyas train {main.get('eyas_args') or 'with its defaults'}", "speculators": "speculators 0.9.0"}
    out = []
    for trainer, points in (res.get("curve") or {}).items():
        note = (
            f"a checkpoint of a {main.get('main_budget_s', '?')} s run of {how.get(trainer, trainer)}, offline "
            f"from one bf16 store; budget_s: its wall clock after the first step; replay, "
            f"{ev.get('eval_dtype', '?')}, {ev.get('eval_max_new', '?')} tokens"
        )
        for p in points:
            steps = p.get("step") or p.get("global_step") or 0
            for pset, by_k in p["reports"].items():
                for rel in by_k.values():  # relative to the work folder, here RUN
                    recs, engine = read_records(run / rel)
                    name = f"{tag}-{trainer}-{p['train_s']:.0f}s"
                    src = f"benchmarks/quality/{tag} (run_quality.py, rest phase of {rest})"
                    out.append(
                        entry(
                            recs,
                            name,
                            target,
                            trainer,
                            pset,
                            round(p["train_s"], 1),
                            steps,
                            samples,
                            engine,
                            source=src,
                            note=note,
                        )
                    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--tag", required=True, help="name prefix of the rows, e.g. quality-2026-12-05")
    ap.add_argument("--dry-run", action="store_true", help="print the rows, leave summary.json alone")
    a = ap.parse_args()
    new = rows(a.run, a.tag)
    if a.dry_run:
        for r in new:
            print(f"{r['name']:40s} {r['prompt_set']:10s} k={r['k']} tau {r['tau']:.3f} ({r['turns']} turns)")
    else:
        upsert(new)
    print(f"{len(new)} rows of {len({r['name'] for r in new})} drafts" + ("" if a.dry_run else " in summary.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
