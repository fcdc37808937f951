"""The sampled regeneration against the greedy one, paired: every sampled draft (t=0.7, 2,000 steps,
one per training seed) against every masked greedy draft of about as many steps; the sampled
10-minute budget against the masked greedy one and against the sampled 2-minute budget; the trimmed
conversations (``--leading-assistant trim``) against the same budgets without them. On MT-bench and
HumanEval at k = 3, 5, 7, from the evaluations kept under ``evals/``. Writes ``sampled_pairs.json``;
the verdicts are in README.md ("Sampled regeneration", "Ten minutes", "Trimmed conversations").

    python benchmarks/recipe/sampled_pairs.py
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "quality"))
from paired import pair_every_k  # noqa: E402

SAMPLED = ["sampled", "sampled-s1", "sampled-s2"]
GREEDY = ["maskloops", "maskloops-rep", "maskloops-s1", "maskloops-s2"]
# (draft, reference): every sampled 2,000-step draft against every masked greedy one, then the
# sampled 10-minute budget against the masked greedy 10 minutes and against its own 2 minutes
PAIRS = [(d, r) for d in SAMPLED for r in GREEDY] + [
    ("sampled-10m", "ml10"),
    ("sampled-10m", "sampled-2m"),
    ("sampled-20m", "sampled-10m"),
    ("trim-2m", "sampled-2m"),
    ("trim-10m", "sampled-10m"),
]
SETS = ["mt_bench", "humaneval"]
KS = [3, 7]


def _row(r: dict) -> dict:
    return {
        "draft": round(r["tau"], 4),
        "reference": round(r["reference_tau"], 4),
        "difference": round(r["difference"], 4),
        "ci95": [round(x, 4) for x in r["difference_ci95"]],
        "turns": r["prompts"],
    }


def main() -> int:
    pairs = []
    for draft, ref in PAIRS:
        for prompt_set in SETS:
            ev = f"eval-{prompt_set}"
            got = pair_every_k(HERE / "evals" / ref / ev, [HERE / "evals" / draft / ev], KS)
            by_k = {5: got["rows"][0], **{k: got["also_k"][str(k)][0] for k in KS}}
            pairs.append(
                {"draft": draft, "reference": ref, "prompt_set": prompt_set}
                | {f"k{k}": _row(by_k[k]) for k in sorted(by_k)}
            )
    out = {
        "what": "each sampled regeneration draft (t=0.7, 2,000 steps; training seeds 0, 1, 2) paired against "
        "each masked greedy 120 s training (1,923-2,036 steps) on the same turns; the sampled 10-minute "
        "budget (sampled-10m, configs/smollm2-h200.yaml) against the masked greedy one (ml10) and "
        "against the sampled 2-minute budget (sampled-2m); the sampled 20-minute budget (sampled-20m) against "
        "the 10-minute one; the trimmed conversations (--leading-assistant trim, 16,969 conversations "
        "against 10,797) at 2 and 10 minutes (trim-2m, trim-10m) against sampled-2m and sampled-10m",
        "date": datetime.date.today().isoformat(),
        "machine": "1x NVIDIA H100 80GB HBM3 (lent), every draft",
        "commits": "sampled: 15243d8; sampled-s1, sampled-s2: fa65612; sampled-2m: fa65612; sampled-10m: "
        "a3ecbac; trim-2m, trim-10m: 58c6d97; the greedy drafts: results-2026-12-06.jsonl",
        "command": "python benchmarks/recipe/sampled_pairs.py (paired.py's bootstrap over questions)",
        "pairs": pairs,
    }
    (HERE / "sampled_pairs.json").write_text(json.dumps(out, indent=1) + "\n")
    for p in pairs:
        k5 = p["k5"]
        print(f"{p['draft']:<11} vs {p['reference']:<14} {p['prompt_set']:<9} k5 {k5['difference']:+.3f} {k5['ci95']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
