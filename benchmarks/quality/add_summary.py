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


def entry(
    recs: list[dict],
    name: str,
    target: str,
    trainer: str,
    prompt_set: str,
    budget_s: float,
    steps: int,
    data_conversations: int,
    engine: str | None = None,
    training_tau: dict | None = None,
    source: str = "",
    note: str = "",
) -> dict:
    """One row of summary.json from a draft's per-turn records (tau and its bootstrap CI)."""
    k = len(recs[0]["accepted_per_pos"])
    lo, hi = bootstrap(recs)
    row = {
        "name": name,
        "target": target,
        "trainer": trainer,
        "budget_s": budget_s,
        "steps": steps,
        "data_conversations": data_conversations,
        "k": k,
        "prompt_set": prompt_set,
        "turns": len(recs),
        "questions": len({r["question_id"] for r in recs}),
        "tau": tau(recs),
        "tau_ci_low": lo,
        "tau_ci_high": hi,
        "source": source,
        "note": note,
    }
    if (training_tau or {}).get(str(k)) is not None:  # what eyas train measured on its own prompts
        row["training_tau"] = training_tau[str(k)]
    if engine:
        row["engine"] = engine
    return row


def upsert(rows_in: list[dict]) -> None:
    """Add rows to summary.json, replacing those of the same name, k and prompt set."""
    key = lambda r: (r["name"], r["k"], r["prompt_set"])  # noqa: E731
    new = {key(r) for r in rows_in}
    rows = json.loads(SUMMARY.read_text()) if SUMMARY.is_file() else []
    SUMMARY.write_text(json.dumps([r for r in rows if key(r) not in new] + rows_in, indent=1) + "\n")


def read_records(path: Path) -> tuple[list[dict], str | None]:
    """A records.jsonl's records, or a report.json's per-prompt ones (the replay engine keeps no
    records file) and its engine."""
    if path.suffix == ".json":
        report = json.loads(path.read_text())
        return report["per_prompt"], report.get("engine")
    return [json.loads(x) for x in path.read_text().splitlines()[1:]], None


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
    recs, engine = read_records(Path(a.records))
    trained = json.loads(Path(a.train_tau).read_text()) if a.train_tau else {}
    row = entry(
        recs,
        a.name,
        a.target,
        a.trainer,
        a.prompt_set,
        a.budget_s,
        a.steps,
        a.data_conversations,
        engine,
        trained.get("tau"),
        a.source,
        a.note,
    )
    upsert([row])
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
