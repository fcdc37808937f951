"""benchmarks/reliability.md is generated from the test_bad_input_* tests: it must match them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reliability_table_is_current():
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reliability_table.py"), "--check"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr + " (run python scripts/reliability_table.py and commit it)"
