"""Training metrics: metrics.jsonl and TensorBoard (:class:`Logger`), step timing on the device's
timeline (:class:`StepClock`), and the loss plot."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch


class StepClock:
    """When training steps end, on the timeline of the device that runs them.

    A step's numbers are read on the host one step late, and the host can reach that read early or
    late: host clocks taken there gave the last record of a run 30x the real rate (issue 16). On
    CUDA a step's end is an event queued behind its work, so rates are real device time; elsewhere
    work is synchronous and the host clock is that timeline."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end`` (waits for ``end`` on CUDA)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


class Logger:
    """metrics.jsonl (+ TensorBoard when installed) on rank 0."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        if self.path.exists():  # drop lines past the checkpoint we resume from (they are redone)
            keep = [ln for ln in self.path.read_text().split("\n")
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(k + "\n" for k in keep))
            os.replace(tmp, self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)
        except ImportError:
            self.tb = None  # tensorboard missing (e.g. a bare GPU box): JSONL still has it all

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            split, step = record["split"], record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{split}/{k}", v, step)
                elif isinstance(v, list):
                    for j, x in enumerate(v):
                        self.tb.add_scalar(f"{split}/{k}_step{j}", x, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_losses(run_dir: Path) -> Path | None:
    """loss.png: training loss and held-out acceptance proxy per TTT step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().split("\n") if ln.strip()]
    train = [r for r in recs if r["split"] == "train"]
    held = [r for r in recs if r["split"] == "heldout"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    axes[0].set(xlabel="step", ylabel="TTT loss", title="training loss")
    if held:
        for j in range(len(held[0]["acc"])):
            axes[1].plot([r["step"] for r in held], [r["acc"][j] for r in held], marker="o", label=f"step {j}")
        axes[1].legend(fontsize=7)
    axes[1].set(xlabel="step", ylabel="top-1 agreement", title="held-out acceptance proxy")
    fig.tight_layout()
    out = run_dir / "loss.png"
    tmp = run_dir / ".loss.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
