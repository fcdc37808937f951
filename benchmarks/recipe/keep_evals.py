"""Keep a sweep's per-turn acceptance in git, so that a later run can be paired with it.

recipe.sh brings back each run's evaluation reports (recipe.tgz); their per-turn records hold the
target's answers too, which are large and the same for every draft. This copies each report without
them into ``benchmarks/recipe/evals/<run>/`` in the layout `benchmarks/quality/paired.py` reads:

    python benchmarks/recipe/keep_evals.py RECIPE_DIR...     # RECIPE_DIR: an unpacked recipe.tgz
    python benchmarks/quality/paired.py --reference benchmarks/recipe/evals/A/eval-mt_bench \\
        --others benchmarks/recipe/evals/B/eval-mt_bench
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEEP = Path(__file__).resolve().parent / "evals"


def keep_report(report: Path, out: Path) -> dict:
    """Write ``report`` to ``out`` without the answers' token ids; returns what was written."""
    rep = json.loads(report.read_text())
    rep["per_prompt"] = [{k: v for k, v in p.items() if k != "output_ids"} for p in rep["per_prompt"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, separators=(",", ":")) + "\n")
    return rep


def keep(recipe_dir: Path) -> list[Path]:
    written = []
    for report in sorted(recipe_dir.glob("*/eval-*/**/report.json")):
        out = KEEP / report.relative_to(recipe_dir)
        keep_report(report, out)
        written.append(out)
    return written


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for d in sys.argv[1:]:
        for p in keep(Path(d)):
            print(p)
