"""Put every recipe draft whose evaluations are kept into benchmarks/quality/summary.json.

Each line of ``results-*.jsonl`` with its replay reports under ``evals/<name>/`` becomes one row per
prompt set and k (tau with a 95% bootstrap CI over questions, the budget, steps and data), named
``recipe-<name>``. Re-running replaces those rows, so it is safe after every sweep:

    python benchmarks/recipe/to_summary.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "quality"))
from add_summary import entry, read_records, upsert  # noqa: E402
from results import runs  # noqa: E402

# conversations behind each prepared dataset the sweeps name (benchmarks/recipe/README.md)
CONVERSATIONS = {
    "prep-regen": 10796,
    "prep-regen-half": 5339,
    "prep-regen-nolen": 2540,
    "prep-regen-ml": 10796,
    "prep-q4000": 2356,
    "prep-q4000-ml": 2356,
}
SETS = {"eval-mt_bench": "mt_bench", "eval-humaneval": "humaneval"}


def length(run: dict) -> str:
    """How long a run trained: its budget, or its step count (a run of --max-steps)."""
    return f"{run['budget_s']:.0f} s budget" if run["budget_s"] is not None else f"{run['steps']:,} steps"


def rows() -> list[dict]:
    out = []
    for results, run in runs():
        data = Path(run["data"]).name
        for sub, prompt_set in SETS.items():
            for report in sorted((HERE / "evals" / run["name"] / sub).glob("**/replay/report.json")):
                recs, engine = read_records(report)
                out.append(
                    entry(
                        recs,
                        f"recipe-{run['name']}",
                        "smollm2-135m-instruct",
                        "eyas",
                        prompt_set,
                        run["budget_s"],
                        run["steps"],
                        run.get("conversations") or CONVERSATIONS[data],
                        engine,
                        run.get("train_tau", {}).get("tau") if prompt_set == "mt_bench" else None,
                        f"benchmarks/recipe/{results.name} "
                        f"(commit {run.get('commit', '?')[:7]}, {run.get('machine', '?')})",
                        f"eyas train {run['args']} {run['common']} (the rest its commit's defaults), online, "
                        f"{length(run)}; "
                        f"replay, bf16, {run.get('max_new_tokens', 256)} tokens",
                    )
                )
    return out


if __name__ == "__main__":
    new = rows()
    upsert(new)
    print(f"{len(new)} rows of {len({r['name'] for r in new})} drafts in benchmarks/quality/summary.json")
