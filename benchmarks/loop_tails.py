"""How many regenerated answers end in a loop that `eyas prepare --mask-loops` masks, split by how the
answer ended (its own stop token, or the --max-new-tokens cap), on a seeded sample of each.

    .venv/bin/python benchmarks/loop_tails.py [--sample 1000] [--target qwen2.5-coder-0.5b-instruct] [--answers DIR]

The answers are those kept in git for the target (``data/regenerated/<target>-sharegpt/``).
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
from pathlib import Path

import numpy as np

from eyas.data.loops import loop_start
from eyas.target import resolve_target

REGENERATED = Path(__file__).resolve().parents[1] / "data/regenerated"


def read_answers(path: Path) -> list[dict]:
    """The records of a kept ``regenerated.jsonl.xz``. Split at newlines only: str.splitlines also
    splits at U+2028 and the like, which answers hold as text."""
    return [json.loads(x) for x in lzma.decompress(path.read_bytes()).decode().split("\n") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sample", type=int, default=1000)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="a built-in target with answers in git")
    ap.add_argument("--answers", help="a folder of the target's answers (default: data/regenerated/TARGET-sharegpt)")
    a = ap.parse_args()
    answers = Path(a.answers or REGENERATED / f"{a.target}-sharegpt") / "regenerated.jsonl.xz"
    if not answers.is_file():
        raise SystemExit(f"{answers}: no regenerated answers kept for target {a.target!r}")
    tok = resolve_target(a.target).load_tokenizer()
    recs = read_answers(answers)
    rng = random.Random(0)
    for finish in ("stop", "length"):
        pool = [r for r in recs if r["finish"] == finish]
        picked = rng.sample(pool, min(a.sample, len(pool)))
        looped = masked = tokens = 0
        for ids in tok([r["text"] for r in picked], add_special_tokens=False)["input_ids"]:
            cut = loop_start(np.asarray(ids))
            tokens += len(ids)
            if cut is not None:
                looped += 1
                masked += len(ids) - cut
        print(
            f"{finish}: {len(pool):,} answers, {len(picked):,} sampled; {looped:,} end in a loop; "
            f"{masked:,} of their {tokens:,} tokens masked ({100 * masked / max(tokens, 1):.1f}%)"
        )


if __name__ == "__main__":
    main()
