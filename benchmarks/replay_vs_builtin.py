"""`eyas evaluate --engine replay` against `--engine builtin` on the same draft and questions.

Runs both through the CLI (`--builtin-from DIR` takes the builtin report of an earlier evaluation
instead, e.g. `eyas pipeline`'s eval/ directory, with the same settings passed here), then compares
their records turn by turn
(output, rounds, accepted per position) and records both wall-clock times. Result:
OUT/replay_vs_builtin.json, and one row appended to RESULT (JSON lines) with date, commit, machine
and command.

    python benchmarks/replay_vs_builtin.py --draft runs/default/train/draft --out /tmp/rvb \\
        --result benchmarks/replay_vs_builtin.jsonl -- --max-per-category 1 --max-new-tokens 64 -k 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str]) -> float:
    print("+ " + shlex.join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return round(time.perf_counter() - start, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--result", type=Path, help="JSON-lines file to append the summary to")
    ap.add_argument("--also-k", default="", help="replay only: more k from the same pass, e.g. 1,2,5,7")
    ap.add_argument(
        "--builtin-from",
        type=Path,
        help="an earlier `eyas evaluate` --out with builtin/report.json at the same settings: "
        "compared against instead of running the builtin engine",
    )
    ap.add_argument("evaluate_args", nargs="*", help="after --: the settings both engines share")
    a = ap.parse_args()
    eyas = [sys.executable, "-m", "eyas.cli", "evaluate", "--draft", a.draft, "--quiet", *a.evaluate_args]
    # the speculative loop alone (no plain-decoding baseline): what replay stands in for
    builtin_s = None if a.builtin_from else run([*eyas, "--engine", "builtin", "--no-plain", "--out", str(a.out)])
    replay_s = run([*eyas, "--engine", "replay", "--out", str(a.out), *(["--also-k", a.also_k] if a.also_k else [])])
    b = json.loads(((a.builtin_from or a.out) / "builtin" / "report.json").read_text())
    r = json.loads((a.out / "replay" / "report.json").read_text())

    def norm(key, value):  # paths as given may be relative to the run's directory or absolute
        return str(Path(value).resolve()) if key in ("prompts", "draft") and value else value

    same = ("num_speculative_tokens", "max_new_tokens", "dtype", "prompts", "target", "draft")
    differ = [f"{x}: {b.get(x)!r} vs {r.get(x)!r}" for x in same if norm(x, b.get(x)) != norm(x, r.get(x))]
    if differ:
        sys.exit("the builtin report was made with other settings than the replay: " + "; ".join(differ))

    def key(p):
        return p["question_id"], p["turn"]

    rb, rr = {key(p): p for p in b["per_prompt"]}, {key(p): p for p in r["per_prompt"]}
    common = sorted(set(rb) & set(rr))
    same_out = sum(rb[t]["output_ids"] == rr[t]["output_ids"] for t in common)
    same_rec = sum(
        (rb[t]["output_ids"], rb[t]["rounds"], rb[t]["accepted_per_pos"])
        == (rr[t]["output_ids"], rr[t]["rounds"], rr[t]["accepted_per_pos"])
        for t in common
    )
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "command": shlex.join([sys.argv[0], *sys.argv[1:]]),
        "k": b["num_speculative_tokens"],
        "turns": len(common),
        "device": b.get("device"),
        "dtype": b.get("dtype"),
        "tau_builtin": b["overall"]["tau"],
        "tau_replay": r["overall"]["tau"],
        "rounds_builtin": b["overall"]["rounds"],
        "rounds_replay": r["overall"]["rounds"],
        "accepted_per_pos_builtin": b["overall"]["accepted_per_pos"],
        "accepted_per_pos_replay": r["overall"]["accepted_per_pos"],
        "identical_outputs": same_out,
        "identical_records": same_rec,
        "builtin_from": str(a.builtin_from) if a.builtin_from else None,
        "builtin_wall_s": b.get("wall_seconds_this_run"),
        "builtin_command_s": builtin_s,
        "replay_references_s": r.get("references_seconds_this_run"),
        "replay_s": r.get("replay_seconds"),
        "replay_command_s": replay_s,
        "replay_also_k": {
            k: v["replay"]["overall"]["tau"]
            for k, v in (
                (d.name, {"replay": json.loads((d / "replay" / "report.json").read_text())})
                for d in sorted(a.out.glob("k*"))
                if (d / "replay" / "report.json").is_file()
            )
        },
    }
    (a.out / "replay_vs_builtin.json").write_text(json.dumps(summary, indent=2) + "\n")
    if a.result:
        with open(a.result, "a") as fh:
            fh.write(json.dumps(summary) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
