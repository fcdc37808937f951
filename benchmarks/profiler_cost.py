"""Does an engine started with vLLM's torch profiler configured (what `eyas evaluate
--speed-profile-steps` does) serve its untraced steps slower? Plain decoding at 1 request, engines
with and without the profiler configured, alternated, each timed with a speed point after a warm
one. A tiny target keeps the step mostly the engine's own CPU work, as at 1 request on the H200.

    .venv/bin/python benchmarks/profiler_cost.py --target DIR [--vllm .venvs/vllm-0.32.0/bin/python]
        [--reps 4] [--seconds 10] [--json benchmarks/profiler_cost.json]

DIR: a model directory vLLM loads (the tests' 6-layer random Llama: `tests/evalkit.make_eval_target`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from eyas.evaluate.vllm_metrics import VllmEngine

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "profiler configured")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--vllm", type=Path, default=ROOT / ".venvs/vllm-0.32.0/bin/python")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    prompts = [[1 + (i * 7 + j) % 200 for j in range(16 + i % 5)] for i in range(16)]
    points: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for n, mode in enumerate(MODES):
                prof = Path(tmp) / f"prof-{rep}" if mode != "none" else None
                log = Path(tmp) / f"{rep}-{n}.log"
                with VllmEngine(a.vllm, a.target, None, k=0, dtype="float32", log_path=log, profile_dir=prof) as eng:
                    eng.speed(prompts, a.tokens, set(), 1, 3.0, 3, "steady")  # warm
                    p = eng.speed(prompts, a.tokens, set(), 1, a.seconds, 3, "steady")
                points[mode].append(p["tokens_per_s"])
                print(f"rep {rep}, {mode}: {p['tokens_per_s']:.1f} tokens/s, {p['requests']} requests", flush=True)
    out = {
        "what": __doc__.splitlines()[0],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{platform.node()} {platform.machine()}",
        "vllm_python": str(a.vllm),
        "target": str(a.target),
        "seconds_per_point": a.seconds,
        "tokens_per_request": a.tokens,
        "tokens_per_s": points,
        "median": {m: statistics.median(v) for m, v in points.items()},
    }
    print(json.dumps(out["median"]))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
