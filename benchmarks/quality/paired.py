"""Paired tau: each evaluation against a reference on the (question, turn) pairs both finished.

Ablations are evaluated on fewer questions than the main draft and can be cut at a deadline;
comparing their tau with the main run's over all 80 questions would mix prompt sets. This
recomputes both over the same prompts (tau = 1 + accepted / rounds, as `eyas evaluate`), with a
95% bootstrap interval of the difference over questions (both turns of a question together).

    python paired.py --reference EVAL_DIR --others EVAL_DIR... [--also-k 3,7] [--json out.json]

EVAL_DIR is an `eyas evaluate --out` directory, of the builtin or the replay engine.
:func:`evaluate_and_pair` runs the evaluations too (replay, one answer set for all drafts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _records(d: Path) -> dict[tuple[int, int], dict]:
    reports = [d / e / "report.json" for e in ("builtin", "replay") if (d / e / "report.json").is_file()]
    if len(reports) != 1:
        raise SystemExit(f"{d}: expected one of builtin/report.json, replay/report.json; found {len(reports)}")
    rep = json.loads(reports[0].read_text())
    return {(r["question_id"], r["turn"]): r for r in rep["per_prompt"]}


def _tau(recs: list[dict]) -> tuple[float, list[float]]:
    from eyas.evaluate.report import aggregate

    agg = aggregate(recs, len(recs[0]["accepted_per_pos"]))
    return agg["tau"], agg["acceptance_rate_per_pos"]


def _bootstrap(ref: dict, oth: dict, common: list, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    import random

    rng = random.Random(seed)
    by_q: dict[int, list] = {}
    for c in common:
        by_q.setdefault(c[0], []).append(c)
    qs = sorted(by_q)
    diffs = []
    for _ in range(n):
        pick = [c for q in (rng.choice(qs) for _ in qs) for c in by_q[q]]
        diffs.append(_tau([oth[c] for c in pick])[0] - _tau([ref[c] for c in pick])[0])
    diffs.sort()
    return diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def pair(reference: Path, others: list[Path]) -> list[dict]:
    """Each of ``others`` against ``reference`` over the turns both have: tau, difference, 95% CI."""
    ref = _records(reference)
    rows = []
    for d in others:
        oth = _records(d)
        common = sorted(set(ref) & set(oth))
        t_ref, r_ref = _tau([ref[c] for c in common])
        t_oth, r_oth = _tau([oth[c] for c in common])
        lo, hi = _bootstrap(ref, oth, common)
        rows.append(
            {
                "name": d.name,
                "prompts": len(common),
                "tau": t_oth,
                "reference_tau": t_ref,
                "difference": t_oth - t_ref,
                "difference_ci95": [lo, hi],
                "rates": r_oth,
                "reference_rates": r_ref,
            }
        )
        print(
            f"{d.name:32s} prompts {len(common):3d}  tau {t_oth:.3f}  reference {t_ref:.3f}  "
            f"diff {t_oth - t_ref:+.3f} [{lo:+.3f}, {hi:+.3f}]  rates {' '.join(f'{x:.3f}' for x in r_oth)}"
        )
    return rows


def evaluate_and_pair(drafts: dict[str, Path], out: Path, evaluate_args: list[str]) -> dict:
    """Every draft by `eyas evaluate --engine replay` into OUT/eval_NAME (the target's answers decoded
    once, OUT/references.jsonl), then each against the first, paired: at -k ("rows") and at each
    --also-k ("also_k")."""
    for name, draft in drafts.items():
        cmd = [
            sys.executable,
            "-m",
            "eyas.cli",
            "evaluate",
            "--engine",
            "replay",
            "--draft",
            str(draft),
            "--out",
            str(out / f"eval_{name}"),
            "--references",
            str(out / "references.jsonl"),
            "--quiet",
            *evaluate_args,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    dirs = [out / f"eval_{name}" for name in drafts]
    also = evaluate_args[evaluate_args.index("--also-k") + 1] if "--also-k" in evaluate_args else ""
    also_k = [int(k) for k in also.split(",") if k]
    return {"reference": dirs[0].name, "evaluate_args": evaluate_args, **pair_every_k(dirs[0], dirs[1:], also_k)}


def pair_every_k(reference: Path, others: list[Path], also_k: list[int]) -> dict:
    """:func:`pair` at the evaluations' -k ("rows") and at each of ``also_k`` ("also_k"), whose
    reports `eyas evaluate --also-k` put in kN/ of the same directories."""
    res: dict = {"rows": pair(reference, others)}
    for k in also_k:
        rows = pair(reference / f"k{k}", [d / f"k{k}" for d in others])
        for row, d in zip(rows, others):
            row["name"] = d.name  # not the kN they were read from
        res.setdefault("also_k", {})[str(k)] = rows
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, type=Path)
    ap.add_argument("--others", nargs="+", required=True, type=Path)
    ap.add_argument("--also-k", default="", help="also pair at these k (the evaluations' kN/), e.g. 3,7")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    res = pair_every_k(a.reference, a.others, [int(k) for k in a.also_k.split(",") if k])
    if a.json:
        a.json.write_text(json.dumps({"reference": str(a.reference), **res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
