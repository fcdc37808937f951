"""Training metrics: each step's record read one step late (:class:`StepLog`), metrics.jsonl and
TensorBoard (:class:`Logger`), step timing on the device's timeline (:class:`StepClock`), the loss
plot."""

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


class StepLog:
    """The host side of every training step, one step late.

    A step's numbers stay on the device until the next step is queued: reading them waits for the
    device, and reading them at once would leave it idle while the host prepares the next step. So
    :meth:`push` takes a step's device tensors and writes the previous step's record: tokens seen,
    loss, per-TTT-step accuracies, the true rate, and the guard's verdict (which may stop the run)."""

    def __init__(
        self,
        logger: "Logger",
        guard: Any,
        clock: StepClock,
        total: int | None,
        log_every: int,
        global_micro: int,
        tokens_seen: int,
        start: int,
        t_start: float,
        progress: bool,
    ):
        self.logger, self.guard, self.clock = logger, guard, clock
        self.total, self.log_every, self.global_micro = total, log_every, global_micro
        self.tokens_seen, self.t_start = tokens_seen, t_start
        self.first_step_s: float | None = None  # from the run's start to its first step's numbers
        self.pending: dict[str, Any] | None = None
        self.t_last, self.tok_last = clock.mark(), 0
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def set_total(self, total: int) -> None:
        """The run's step count, once known (a --budget run plans it after its first steps)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def push(self, record: dict[str, Any]) -> None:
        """This step's numbers (device tensors) in; the previous step's record out."""
        self.flush()
        self.pending = record

    def flush(self) -> None:
        """Write the pending step's record now (before an evaluation, a checkpoint, the end)."""
        from eyas.train.parallel import total_norm

        if self.pending is None:
            return
        p, self.pending = self.pending, None
        totals, per_step, done = p["totals"].tolist(), p["per_step"].cpu(), p["step"]
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.t_start
        finite = bool(p["finite"])
        self.tokens_seen += int(totals[1])
        self.tok_last += int(totals[1])
        cnt = per_step[2].clamp_min(1)
        step_loss = (per_step[0] / cnt).tolist()
        grad_norm = total_norm(p["grad_norm"])
        self.guard.record(
            finite,
            done,
            {"step_loss": step_loss, "grad_norm": grad_norm, "samples": sorted(i for pack in p["packs"] for i in pack)},
        )
        if done % self.log_every == 0 or done == self.total or not finite:
            secs = self.clock.seconds(self.t_last, p["end"])  # the device's time between the two steps' ends
            tps = self.tok_last / max(secs, 1e-9)
            self.t_last, self.tok_last = p["end"], 0
            rec = {
                "split": "train",
                "step": done,
                "loss": totals[0] / self.global_micro,
                "lr": p["lr"],
                "grad_norm": grad_norm,
                "tokens": self.tokens_seen,
                "tokens_per_s": tps,
                "epoch": p["epoch"],
                "finite": finite,
                "skipped_steps": self.guard.skipped,
                # since this process started training (setup included): x of a tau-against-time curve
                "elapsed_s": round(time.perf_counter() - self.t_start, 2),
                "time": round(time.time(), 2),  # the wall clock, to line the record up with other logs
                "acc": (per_step[1] / cnt).tolist(),
                "step_loss": step_loss,
            }
            self.logger.log(rec)
            self.guard.stop_if_repeated()
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.2f}", tok_s=f"{tps:,.0f}")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        self.flush()
        if self.bar is not None:
            self.bar.close()


class Logger:
    """metrics.jsonl (+ TensorBoard when installed) on rank 0."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        if self.path.exists():  # drop lines past the checkpoint we resume from (they are redone)
            keep = [
                ln
                for ln in self.path.read_text().split("\n")
                if ln.strip() and json.loads(ln).get("step", 0) <= resume_step
            ]
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


def plot_tau(run_dir: Path) -> Path | None:
    """tau.png: tau measured by replay while training (--tau) against training time, one line per k,
    and the learning rate beside it: a draft measured before the decay is not yet annealed, so its
    tau is below what a run planned to end there gives."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(ln) for ln in path.read_text().split("\n") if ln.strip()] if path.is_file() else []
    tau = [r for r in recs if r["split"] == "tau"]
    if not tau:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in tau[-1]["tau"]:
        pts = [(r["train_s"] / 60, r["tau"][k]) for r in tau if r["tau"].get(k) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"k={k}")
    ax.set(
        xlabel="training time (min, steps only)",
        ylabel="tau (replay, greedy)",
        title=f"tau while training: {tau[-1]['turns']} turns of {Path(tau[-1]['prompts']).parent.name}",
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    train = [r for r in recs if r["split"] == "train" and r.get("lr") is not None]
    if train:
        import numpy as np

        # steps to training time through the tau records' (step, train_s) pairs
        at_step = [0] + [r["step"] for r in tau]
        at_s = [0.0] + [r["train_s"] / 60 for r in tau]
        lr_ax = ax.twinx()
        lr_ax.plot(
            np.interp([r["step"] for r in train], at_step, at_s), [r["lr"] for r in train], color="0.6", lw=1, ls="--"
        )
        lr_ax.set_ylabel("learning rate (dashed)", color="0.4")
        lr_ax.set_ylim(bottom=0)
    fig.tight_layout()
    out = run_dir / "tau.png"
    tmp = run_dir / ".tau.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
