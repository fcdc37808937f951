"""The recipe sweep (issue 30): `eyas train` configurations at one time budget, each draft's tau by
`eyas evaluate --engine replay` on MT-bench and on HumanEval (the second prompt set, tuned on by
nothing), at k = 3, 5, 7.

Runs as a user would, with eyas's own commands: every training is `eyas train --online --budget B
...` alone on the GPU (equal wall-clock per configuration, the steps' time), then its two
evaluations at once (replay does not depend on timing), and its line is written to RESULTS (and
`--mirror`) at once. Resumable over device calls: a finished configuration has its line and is not
run again; one whose training was cut off is started afresh, or, with `--save-every N` (budgets
longer than a device call), continued from its last checkpoint (`eyas train --resume`: the budget's
clock goes on where the checkpoint left it). `--deadline-s`: no configuration starts that would not
end before it; with `--save-every`, a training is instead stopped at the deadline and resumed by the
next call.

    python benchmarks/recipe/sweep.py --data PREPARED --runs DIR --results results.jsonl \\
        --budget 120 --deadline-s 540 --configs benchmarks/recipe/sweep1.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT_SETS = {"mt_bench": REPO / "data/mt_bench/question.jsonl", "humaneval": REPO / "data/humaneval/question.jsonl"}
KS = (3, 5, 7)
# What a training adds to its budget (start, target load, first compiled step, the final
# evaluation and tau), for the deadline; the first run also decodes the tau references.
TRAIN_OVERHEAD_S = 45


def log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], log_path: Path, timeout_s: float | None = None) -> int | None:
    """The command's exit code; None if it was stopped at ``timeout_s``."""
    log(" ".join(shlex.quote(c) for c in cmd))
    with open(log_path, "a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None


def train(name: str, args: list[str], data: str, a, out: Path, timeout_s: float | None) -> bool:
    if (out / "summary.json").is_file() and (out / "draft" / "model.safetensors").is_file():
        return True
    resume = bool(a.save_every) and bool(list(out.glob("checkpoints/step-*")))
    if not resume:  # cut off by an earlier call without checkpoints: again from the start
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    cmd = [
        "eyas",
        "train",
        "--data",
        data,
        "--online",
        "--out",
        str(out),
        "--budget",
        str(a.budget),
        "--tau-every",
        str(a.tau_every),
        "--quiet",
        *shlex.split(a.common),
        *args,
        *(["--save-every", str(a.save_every)] if a.save_every else []),
        *(["--resume"] if resume else []),
    ]
    t = time.perf_counter()
    rc = run(cmd, out / "train.log", timeout_s if a.save_every else None)
    log(
        f"{name}: train "
        + ("stopped at the deadline: the next call resumes it" if rc is None else f"exit {rc}")
        + f" after {time.perf_counter() - t:.0f} s"
    )
    return rc == 0


def evaluate(name: str, out: Path, a) -> dict:
    """Replay on each prompt set (both at once), k = 3, 5, 7 from one pass; the target's answers
    shared per set."""
    with ThreadPoolExecutor(len(PROMPT_SETS)) as pool:
        got = dict(pool.map(lambda p: (p, evaluate_set(name, out, a, p)), PROMPT_SETS))
    return {p: t for p, t in got.items() if t is not None}


def evaluate_set(name: str, out: Path, a, pset: str) -> dict | None:
    dest = out / f"eval-{pset}"
    if not (dest / "replay" / "report.json").is_file():
        cmd = [
            "eyas",
            "evaluate",
            "--engine",
            "replay",
            "--draft",
            str(out / "draft"),
            "--prompts",
            str(PROMPT_SETS[pset]),
            "-k",
            str(KS[1]),
            "--also-k",
            ",".join(str(k) for k in KS if k != KS[1]),
            "--max-new-tokens",
            str(a.max_new_tokens),
            "--references",
            str(Path(a.runs) / f"references-{pset}.jsonl"),
            "--out",
            str(dest),
            "--quiet",
            *shlex.split(a.evaluate),
        ]
        rc = run(cmd, out / f"eval-{pset}.log")
        if rc:
            log(f"{name}: evaluate {pset} exit {rc}")
            return None
    got = {}
    for k in KS:
        sub = dest if k == KS[1] else dest / f"k{k}"
        rep = json.loads((sub / "replay" / "report.json").read_text())
        got[str(k)] = {"tau": rep["overall"]["tau"], "turns": rep["overall"]["prompts"]}
    return got


def result(name: str, args: list[str], data: str, out: Path, taus: dict, a) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    last = [r for r in recs if r["split"] == "train"][-1]
    return {
        "name": name,
        "args": " ".join(args),
        "data": data,
        "common": a.common,
        "budget_s": a.budget,
        "steps": summary["steps"],
        "steps_s": summary["steps_s"],
        "first_step_s": summary["first_step_s"],
        "epochs": summary["epochs"],
        "tokens_seen": summary["tokens_seen"],
        "final_loss": last["loss"],
        "finite": all(r.get("finite", True) for r in recs if r["split"] == "train"),
        "tau": taus,
        "train_tau": summary.get("tau"),
        "train_tau_curve": [
            {"train_s": r["train_s"], "step": r["step"], "tau": r["tau"]} for r in recs if r["split"] == "tau"
        ],
        "max_new_tokens": a.max_new_tokens,
        "commit": a.commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": a.machine,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="prepared dataset (eyas prepare)")
    ap.add_argument("--runs", required=True, help="directory of the runs (and the shared reference answers)")
    ap.add_argument("--results", required=True, help="JSONL: one line per finished configuration")
    ap.add_argument(
        "--configs",
        required=True,
        help="JSON: [[name, 'eyas train args'], ...] run in order; a third item {\"data\": DIR} trains on "
        "another prepared dataset than --data (a data variant)",
    )
    ap.add_argument("--budget", type=float, default=120, help="seconds of steps per training (--budget)")
    ap.add_argument("--tau-every", default="30s", help="eyas train --tau-every")
    ap.add_argument("--common", default="", help="train args every configuration shares")
    ap.add_argument("--evaluate", default="", help="extra eyas evaluate args (device, dtype)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument(
        "--deadline-s", type=float, default=None, help="seconds from now: no training starts that would end after it"
    )
    ap.add_argument("--eval-s", type=float, default=90, help="a configuration's evaluations, for the deadline")
    ap.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="checkpoint every N steps and resume a training cut off by the deadline (budgets past one call)",
    )
    ap.add_argument("--mirror", default=None, help="a second copy of RESULTS, written with it (the call's $OUT)")
    ap.add_argument("--only", default=None, help="comma-separated names: run just these")
    ap.add_argument("--commit", default="?")
    ap.add_argument("--machine", default="?")
    a = ap.parse_args()
    t0 = time.perf_counter()
    runs, results = Path(a.runs), Path(a.results)
    runs.mkdir(parents=True, exist_ok=True)
    done = (
        {json.loads(ln)["name"] for ln in results.read_text().splitlines() if ln.strip()}
        if results.is_file()
        else set()
    )
    configs = [
        (c[0], shlex.split(c[1]), (c[2] if len(c) > 2 else {}).get("data", a.data))
        for c in json.loads(Path(a.configs).read_text())
    ]
    if a.only:
        keep = set(a.only.split(","))
        configs = [c for c in configs if c[0] in keep]
    n = 0
    for name, args, data in configs:
        if name in done:
            continue
        left = (a.deadline_s - (time.perf_counter() - t0)) if a.deadline_s else float("inf")
        # without checkpoints a training must fit whole; with them, a minute of progress is worth a start
        need = (60 if a.save_every else a.budget) + TRAIN_OVERHEAD_S + a.eval_s
        if left < need:
            log(f"{name}: {left:.0f} s left before the deadline, not started")
            break
        if not train(name, args, data, a, runs / name, left - a.eval_s):
            if a.save_every:
                break  # stopped at the deadline (or failed): nothing else fits in this call
            continue
        got = evaluate(name, runs / name, a)
        if len(got) != len(PROMPT_SETS):
            continue
        line = json.dumps(result(name, args, data, runs / name, got, a)) + "\n"
        for path in [results] + ([Path(a.mirror)] if a.mirror else []):
            with open(path, "a") as fh:
                fh.write(line)
        n += 1
        log(
            f"{name}: "
            + "; ".join(f"{p} " + " ".join(f"k{k}={v['tau']:.3f}" for k, v in t.items()) for p, t in got.items())
        )
    log(f"done in {time.perf_counter() - t0:.0f} s: {n} configurations this call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
