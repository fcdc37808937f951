"""Add (or replace) one measured draft in benchmarks/quality/summary.json, issue 20's machine-readable record.

tau is computed from the evaluation's records as `eyas evaluate` does (1 + accepted / rounds),
with a 95% bootstrap interval over questions (both turns of a question resampled together).

    python3 benchmarks/quality/add_summary.py --records RECORDS.jsonl|REPORT.json --name NAME --target T \
        --trainer eyas --budget-s S --steps N --data-conversations C --prompt-set mt_bench \
        [--train-tau DRAFT/tau.json] [--source FILE] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SUMMARY = Path(__file__).with_name("summary.json")


def tau(recs: list[dict]) -> float:
    return 1 + sum(sum(r["accepted_per_pos"]) for r in recs) / sum(r["rounds"] for r in recs)


def bootstrap(recs: list[dict], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    by_q: dict[int, list[dict]] = {}
    for r in recs:
        by_q.setdefault(r["question_id"], []).append(r)
    qs, rng, taus = list(by_q), random.Random(seed), []
    for _ in range(n):
        taus.append(tau([r for q in rng.choices(qs, k=len(qs)) for r in by_q[q]]))
    taus.sort()
    return taus[int(0.025 * n)], taus[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--records", "--name", "--target", "--trainer", "--prompt-set"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--data-conversations", type=int, required=True)
    ap.add_argument("--train-tau", help="the draft's tau.json (eyas train --tau)")
    ap.add_argument("--source", default="")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    path = Path(a.records)
    if path.suffix == ".json":  # a report.json (the replay engine keeps no records file): its per-prompt records
        report = json.loads(path.read_text())
        recs, engine = report["per_prompt"], report.get("engine")
    else:
        recs, engine = [json.loads(x) for x in path.read_text().splitlines()[1:]], None
    k = len(recs[0]["accepted_per_pos"])
    lo, hi = bootstrap(recs)
    trained = json.loads(Path(a.train_tau).read_text()) if a.train_tau else {}
    entry = {
        "name": a.name,
        "target": a.target,
        "trainer": a.trainer,
        "budget_s": a.budget_s,
        "steps": a.steps,
        "data_conversations": a.data_conversations,
        "k": k,
        "prompt_set": a.prompt_set,
        "turns": len(recs),
        "questions": len({r["question_id"] for r in recs}),
        "tau": tau(recs),
        "tau_ci_low": lo,
        "tau_ci_high": hi,
        "source": a.source,
        "note": a.note,
    }
    if trained.get("tau", {}).get(str(k)) is not None:  # what eyas train measured on its own prompts
        entry["training_tau"] = trained["tau"][str(k)]
    if engine:
        entry["engine"] = engine
    rows = json.loads(SUMMARY.read_text()) if SUMMARY.is_file() else []
    rows = [r for r in rows if not (r["name"] == a.name and r["k"] == k and r["prompt_set"] == a.prompt_set)]
    SUMMARY.write_text(json.dumps(rows + [entry], indent=1) + "\n")
    print(json.dumps(entry, indent=1))


if __name__ == "__main__":
    main()
