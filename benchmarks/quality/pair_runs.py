"""Pair eyas's run of one quality comparison with speculators' run of another (run_quality.py).

A 10-minute run of each trainer does not fit one session's device time with the other's, so each
can train in a session of its own, on the same data (the same seeded conversations and store
settings) and the same prompt sets. RUN_E and RUN_S are folders holding such a comparison's
``results.json`` with its work files unpacked beside it (``gpu_job.sh quality``'s ``quality.tgz``).
This pairs RUN_E's eyas drafts with RUN_S's speculators drafts over the turns both evaluated, as
the rest phase does within one run (``results.json["paired"]``: the final drafts, and the newest
checkpoint of each curve at or just before each mark):

    python benchmarks/quality/pair_runs.py RUN_E RUN_S [--marks-s 180,600] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run_quality import paired_runs, prompt_sets  # noqa: E402


def pair_runs(run_e: Path, run_s: Path, marks_s: str | None = None) -> list[dict]:
    res_e, res_s = (json.loads((r / "results.json").read_text()) for r in (run_e, run_s))
    rest = next((v for k, v in res_e["args"].items() if k.startswith("rest")), None)
    if rest is None:
        raise SystemExit(f"{run_e}: no rest phase in results.json: nothing was evaluated")
    a = argparse.Namespace(**{**rest, **({"marks_s": marks_s} if marks_s else {})})
    for who, res, run in (("eyas", res_e, run_e), ("speculators", res_s, run_s)):
        if not (res.get("curve") or {}).get(who):
            raise SystemExit(f"{run}: its results.json has no {who} curve")
    res = {"curve": {"eyas": res_e["curve"]["eyas"], "speculators": res_s["curve"]["speculators"]}}
    finals = (run_e / "eval_eyas", run_s / "eval_speculators")
    return paired_runs(a, res, list(prompt_sets(a)), finals, (run_e, run_s))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_e", type=Path, help="the comparison whose eyas run is paired")
    ap.add_argument("run_s", type=Path, help="the comparison whose speculators run is paired")
    ap.add_argument("--marks-s", help="training times to pair at (default: RUN_E's rest phase's)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    rows = pair_runs(a.run_e, a.run_s, a.marks_s)
    for r in rows:
        lo, hi = r["difference_ci95"]
        print(
            f"{r['at']:>6} {r['prompt_set']:10s} k={r['k']}  eyas {r['eyas_tau']:.3f}  speculators "
            f"{r['speculators_tau']:.3f}  x{r['ratio']:.3f}  diff {r['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]  "
            f"({r['turns']} turns)"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
