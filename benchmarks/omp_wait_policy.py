"""Greedy decoding speed of the default target on the CPU under OpenMP wait settings (spinning
without end, not spinning, spinning briefly), on free cores and beside a process that keeps one
core busy (as a vLLM engine or another job does).

    PYTHONPATH=src .venv/bin/python benchmarks/omp_wait_policy.py [--repeats 3] [--json OUT.json]

Each measurement is a fresh interpreter: torch's OpenMP runtime reads its settings when it loads, and
the probe imports torch before eyas.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone

PROBE = """
import time, torch
from eyas.target import resolve_target
m = resolve_target("smollm2-135m-instruct").load_model(dtype=torch.float32)
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
with torch.no_grad():
    m.generate(ids, max_new_tokens=4, do_sample=False)
    t0 = time.perf_counter()
    m.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
print(time.perf_counter() - t0)
"""


# each an environment for torch's OpenMP runtime (libgomp on Linux); eyas sets none of these itself
# when one is given, so the probe runs as the setting says
SETTINGS = {
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
}


def measure(setting: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(SETTINGS[setting])
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for busy in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for setting in SETTINGS:
                secs = [measure(setting) for _ in range(a.repeats)]
                rows.append(
                    {
                        "busy_core": busy,
                        "setting": setting,
                        "seconds_32_tokens": secs,
                        "best": min(secs),
                        "load_avg_after": os.getloadavg()[0],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        finally:
            if spinner:
                spinner.kill()
    rec = {
        "what": "SmolLM2-135M fp32, HF generate, 32 greedy tokens after an 8-token prompt, torch's default threads",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rec, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
