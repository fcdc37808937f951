"""The recipe sweeps' results files, read one way for every script that reads them.

Each line of ``results-*.jsonl`` is one trained configuration (``README.md`` says what it holds).
The first lines, of 2026-12-03, name no ``data``: they trained on all of ShareGPT regenerated,
``prep-regen``, which is filled in here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = "/root/park/prep-regen"


def runs() -> Iterator[tuple[Path, dict]]:
    """(results file, run) for every line of every results file, oldest file first."""
    for results in sorted(HERE.glob("results-*.jsonl")):
        for line in results.read_text().splitlines():
            run = json.loads(line)
            run.setdefault("data", DEFAULT_DATA)
            yield results, run
