"""`eyas train --features vllm` beside offline (store) and online training, on the same samples (CPU).

One run of this script trains the same draft three ways, one after the other, on one prepared
dataset and one target, with the same settings:

- offline: `eyas extract --backend vllm` (fp32 store; its time is reported apart), then `eyas train --store`;
- online: `eyas train --online` (the HF target in the training process);
- vllm: `eyas train --features vllm` with a small --feature-buffer-gb; the buffer directory is polled
  from here every few ms for its peak bytes.

Per row: steady tokens/s (median of the per-step records, metrics.jsonl), wall tokens/s (tokens
trained over the whole command, start-up included), and for vllm the report the run writes
(features.json: the trainer's wait on the engine, the engine's start-up and busy time, how often the
buffer held it back, the accounting's peak bytes). With --evaluate, the three drafts' tau by
`eyas evaluate --engine replay`, online and vllm each against offline, paired.

    .venv/bin/python benchmarks/train_stream_bench.py --target smollm2-135m-instruct --data PREPARED \\
        --vllm-python 0.32.0 --out /tmp/bench --json benchmarks/train_stream_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from diskpeak import DiskPeak  # noqa: E402  (the tests' buffer poller: one way to measure the peak)


def _run(cmd: list[str]) -> float:
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if res.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return time.perf_counter() - t


def _row(name: str, run: Path, wall: float) -> dict:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    tokens = train[-1]["tokens"]  # the records carry the tokens seen so far
    return {
        "features": name,
        "steps": len(train),
        "tokens": tokens,
        "steady_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in train[1:]), 1),
        "wall_s": round(wall, 1),
        "wall_tokens_per_s": round(tokens / wall, 1),
        "final_loss": train[-1]["loss"],
        "load_after": os.getloadavg()[0],
    }


def _machine() -> str:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{os.cpu_count()} CPUs, " + (", ".join(gpus) if gpus else "no GPU (the shared 2-core CPU box)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True)
    ap.add_argument("--vllm-python", default="0.32.0")
    ap.add_argument("--out", required=True)
    ap.add_argument("--buffer-gb", type=float, default=0.03)
    ap.add_argument("--json", required=True)
    ap.add_argument(
        "--extract-args",
        default="--dtype fp32 --model-dtype fp32",
        help="the offline row's `eyas extract` settings (on a GPU: --dtype bf16)",
    )
    ap.add_argument(
        "--evaluate",
        default="",
        help="`eyas evaluate` settings: if given, the three drafts are evaluated by replay (one "
        "answer set) and online and vllm compared with offline, paired (issue 21's 'tau equal "
        "within noise'), e.g. '--device cuda --dtype bfloat16 -k 5 --max-new-tokens 256'",
    )
    ap.add_argument(
        "--train",
        default="--ttt-steps 3 --tokens-per-batch 1024 --epochs 1 --warmup 2 "
        "--eval-every 0 --eval-batches 1 --save-every 0 --device cpu --quiet",
    )
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    eyas = [sys.executable, "-m", "eyas.cli"]
    base = ["--target", a.target, "--data", a.data, *a.train.split()]
    rows = []
    t_ext = _run(
        [
            *eyas,
            "extract",
            "--target",
            a.target,
            "--data",
            a.data,
            "--out",
            str(out / "store"),
            "--backend",
            "vllm",
            "--vllm-python",
            a.vllm_python,
            *a.extract_args.split(),
            "--quiet",
        ]
    )
    off = _row(
        "offline (store)",
        out / "offline",
        _run(
            [
                *eyas,
                "train",
                *base,
                "--out",
                str(out / "offline"),
                "--features",
                "offline",
                "--store",
                str(out / "store"),
            ]
        ),
    )
    off["extract_s"] = round(t_ext, 1)
    off["wall_with_extract_tokens_per_s"] = round(off["tokens"] / (off["wall_s"] + t_ext), 1)
    rows.append(off)
    rows.append(
        _row(
            "online (HF target in process)",
            out / "online",
            _run([*eyas, "train", *base, "--out", str(out / "online"), "--online"]),
        )
    )
    buf = out / "buffer"
    poll = DiskPeak(buf, interval=0.005)
    wall = _run(
        [
            *eyas,
            "train",
            *base,
            "--out",
            str(out / "vllm"),
            "--features",
            "vllm",
            "--vllm-python",
            a.vllm_python,
            "--feature-buffer-gb",
            str(a.buffer_gb),
            "--feature-buffer-dir",
            str(buf),
        ]
    )
    peak = poll.stop()
    row = _row("vllm (streamed)", out / "vllm", wall)
    rep = json.loads((out / "vllm" / "features.json").read_text())
    row.update(
        {
            "buffer_limit_bytes": rep["buffer_limit_bytes"],
            "peak_buffer_bytes_polled": peak,
            "poll_samples": poll.samples,
            "peak_buffer_bytes_accounted": rep["peak_buffer_bytes"],
            "trainer_wait_s": rep["trainer_wait_s"],
            "first_call_wait_s": rep["first_call_wait_s"],
            "wait_after_first_call_s": round(rep["trainer_wait_s"] - rep["first_call_wait_s"], 3),
            "engine_start_s": rep["engine_start_s"],
            "engine_busy_s": rep["engine_busy_s"],
            "engine_held_back_s": rep["engine_held_back_s"],
            "engine_held_back_times": rep["engine_held_back_times"],
            "tokens_extracted": rep["tokens_extracted"],
            "vllm": rep["vllm"],
            "backend": rep["backend"],
        }
    )
    rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "machine": _machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "train_settings": a.train,
        "rows": rows,
    }
    if a.evaluate:
        sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
        from paired import evaluate_and_pair

        res["tau"] = evaluate_and_pair(
            {n: out / n / "draft" for n in ("offline", "online", "vllm")},
            out,
            ["--target", a.target, *a.evaluate.split()],
        )
    Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
