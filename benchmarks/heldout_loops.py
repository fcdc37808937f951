"""How much of a text repeats itself: the fraction of tokens whose preceding N tokens already occurred
earlier in the same answer (a loop), in the kept self-distilled ShareGPT answers (whole, and their
first HORIZON tokens) and in the target's own MT-bench answers (an evaluation's records).

Why: `eyas train`'s held-out agreement over whole self-distilled answers predicted a tau 30-35% above
the one measured on MT-bench (benchmarks/gpu_job.md). Loops are easy to predict, so a held-out set
full of them overstates agreement.

    .venv/bin/python benchmarks/heldout_loops.py [--answers XZ] [--records RECORDS.jsonl] [--json OUT.json]

heldout_loops.json was measured on the greedy answers, in git until 2026-12-07 (since then the
sampled ones): `git show fa65612:data/regenerated/smollm2-135m-instruct-sharegpt/regenerated.jsonl.xz`
gives them back for --answers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSWERS = ROOT / "data/regenerated/smollm2-135m-instruct-sharegpt/regenerated.jsonl.xz"
RECORDS = ROOT / "benchmarks/gpu_job/pipeline-2026-12-02-s4/builtin-records.jsonl"


def repeats(ids: list[int], n: int) -> int:
    """Tokens whose preceding ``n`` tokens occurred as a context earlier in ``ids``."""
    seen, hits = set(), 0
    for i in range(n, len(ids)):
        key = tuple(ids[i - n : i])
        hits += key in seen
        seen.add(key)
    return hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", type=Path, default=ANSWERS, help="a kept regenerated.jsonl.xz")
    ap.add_argument("--records", type=Path, default=RECORDS)
    ap.add_argument("--context", type=int, default=8)
    ap.add_argument("--horizon", type=int, default=256)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    a = ap.parse_args()
    from loop_tails import read_answers  # beside this file

    from eyas.target import resolve_target

    tok = resolve_target("smollm2-135m-instruct").load_tokenizer()
    answers = [r["text"] for r in read_answers(a.answers)]
    whole = [0, 0]
    first = [0, 0]
    for i in range(0, len(answers), 2000):
        for ids in tok(answers[i : i + 2000], add_special_tokens=False)["input_ids"]:
            whole[0] += repeats(ids, a.context)
            whole[1] += len(ids)
            first[0] += repeats(ids[: a.horizon], a.context)
            first[1] += len(ids[: a.horizon])
    recs = [json.loads(x) for x in a.records.read_text().splitlines()[1:] if x.strip()]
    mt = [sum(repeats(r["output_ids"], a.context) for r in recs), sum(len(r["output_ids"]) for r in recs)]
    out = {
        "context_tokens": a.context,
        "horizon": a.horizon,
        "sharegpt_regenerated": {"answers": len(answers), "tokens": whole[1], "repeat_fraction": whole[0] / whole[1]},
        "sharegpt_regenerated_first": {"tokens": first[1], "repeat_fraction": first[0] / first[1]},
        "mt_bench_answers": {
            "records": str(a.records.relative_to(ROOT)),
            "turns": len(recs),
            "tokens": mt[1],
            "repeat_fraction": mt[0] / mt[1],
        },
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{platform.machine()} {platform.node()}",
        "command": "python benchmarks/heldout_loops.py",
    }
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
