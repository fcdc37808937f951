"""Run speculators==0.9.0's own EAGLE-3 trainer under a wall-clock budget.

speculators' trainer is driven by epochs / --max-steps, not time. To give it the same
wall-clock budget as eyas without changing its code or its defaults (muon, lr 1e-3, linear
schedule with 1% warmup, KL loss, 3 TTT steps, norm_before_fc / norm_output / norm_before_
residual, total_seq_len 8192, 10% validation split, per-epoch validation and checkpoints):

1. probe: its trainer runs ``--probe-steps`` steps and one more in a second epoch
   (``--epochs 2 --max-steps P``), timing every step through the trainer's own
   ``step_callback`` hook, both validation epochs (the first compiles the no-grad graph, the
   second is steady) and the checkpoint saves;
2. plan: the most steps that fit in ``--budget-s`` (steady step time per step, plus the steady
   validation and a checkpoint per started epoch), given as ``--epochs`` and ``--max-steps``, over
   which its LR schedule decays;
3. run: the trainer from scratch with that plan. A timer sends SIGTERM at the budget plus the
   allowance, which speculators' graceful-shutdown handler turns into an ``interrupted``
   checkpoint (so an overrun is cut, never extended).

The budget clock starts at the end of the run's first optimizer step (model and data-loader
setup, ``setup_s``, and the first step with its ``torch.compile``, ``first_step_s``, are
logged but not counted; eyas's runs are planned from steady step times the same way) and
covers the remaining training, its validation epochs and its checkpoints. The first validation
epoch's compilation is compilation too: the timer gets it as an allowance (``allowance_s``:
first minus steady validation time in the probe, or ``--allowance-s`` without a probe), and the
plan does not spend it. Writes ``OUT/spec_train.json`` with the plan, timings and the
checkpoint directory to evaluate.

``--cpu`` (tests on machines without an accelerator only): 0.9.0's trainer moves the model to
device index 0 and pins memory unconditionally; the flag makes it use the CPU instead. Nothing
else is changed.

Usage (speculators importable, e.g. PYTHONPATH with the carried wheels):
    python spec_train.py --verifier T --data D --out O --budget-s 120 [--probe-steps 30]
        [--ttt-steps N] [-- extra speculators flags]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path


class Probe:
    """What the instrumented trainer reports back (observation only)."""

    def __init__(self) -> None:
        self.trainer = None
        self.steps: list[float] = []  # perf_counter after each optimizer step
        self.run_start: float | None = None
        self.run_end: float | None = None
        self.val_s: list[float] = []
        self.ckpt_s: list[float] = []
        # per maybe_save_checkpoint call: its epoch and the seconds after the first step it began at
        self.ckpt_at: list[dict] = []
        self.interrupted = False
        self.timer: threading.Timer | None = None

    def summary(self) -> dict:
        d = [b - a for a, b in zip(self.steps, self.steps[1:])]
        steady = d[len(d) // 3 :] if len(d) >= 3 else d
        return {
            "steps": len(self.steps),
            "after_first_step_s": (self.run_end - self.steps[0]) if self.steps and self.run_end else None,
            "first_step_s": (self.steps[0] - self.run_start) if self.steps and self.run_start else None,
            "step_s_median": statistics.median(steady) if steady else None,
            "loop_s": (self.run_end - self.run_start) if self.run_end and self.run_start else None,
            "val_s": self.val_s,
            "ckpt_s": self.ckpt_s,
            "ckpt_at": self.ckpt_at,
            "steps_per_epoch": len(self.trainer.train_loader) if self.trainer is not None else None,
            "interrupted": self.interrupted,
        }


def instrument(probe: Probe, budget_s: float | None, cpu: bool) -> None:
    """Wrap speculators' Trainer methods to time them (and arm the budget timer)."""
    import speculators.train.trainer as tr

    T = tr.Trainer
    orig = {n: getattr(T, n) for n in ("__init__", "train_epoch", "val_epoch", "maybe_save_checkpoint", "run_training")}

    def __init__(self, *a, **k):
        probe.trainer = self
        orig["__init__"](self, *a, **k)

    def train_epoch(self, epoch, *, step_callback=None):
        def cb():
            probe.steps.append(time.perf_counter())
            if len(probe.steps) == 1 and budget_s is not None:
                # the budget runs from the end of the first step: compilation and warm-up are
                # not counted (eyas's runs are planned the same way, from steady step times)
                timer = threading.Timer(budget_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
                timer.daemon = True
                timer.start()
                probe.timer = timer
            if step_callback is not None:
                step_callback()

        return orig["train_epoch"](self, epoch, step_callback=cb)

    def val_epoch(self, epoch):
        t = time.perf_counter()
        try:
            return orig["val_epoch"](self, epoch)
        finally:
            probe.val_s.append(time.perf_counter() - t)

    def maybe_save_checkpoint(self, epoch, local_step=0):
        t = time.perf_counter()
        probe.ckpt_at.append({"epoch": str(epoch), "after_first_step_s": (t - probe.steps[0]) if probe.steps else None})
        try:
            return orig["maybe_save_checkpoint"](self, epoch, local_step=local_step)
        finally:
            probe.ckpt_s.append(time.perf_counter() - t)
            if epoch == "interrupted":
                probe.interrupted = True

    def run_training(self):
        probe.run_start = time.perf_counter()
        try:
            return orig["run_training"](self)
        finally:
            if probe.timer is not None:
                probe.timer.cancel()
            probe.run_end = time.perf_counter()

    T.__init__, T.train_epoch, T.val_epoch = __init__, train_epoch, val_epoch
    T.maybe_save_checkpoint, T.run_training = maybe_save_checkpoint, run_training
    if cpu:
        _cpu_shims()


def restore(saved: dict) -> None:
    import speculators.train.trainer as tr

    for n, f in saved.items():
        setattr(tr.Trainer, n, f)


def _cpu_shims() -> None:
    """Let 0.9.0's trainer run without an accelerator (tests only): CPU device, no pinned memory,
    no accelerator synchronisation in its step timer."""
    import functools

    import torch
    import torch.utils.data
    import speculators.train.dataloader as dl
    import speculators.train.trainer as tr

    tr.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():  # its step timer synchronizes the accelerator
        torch.accelerator.synchronize = lambda *a, **k: None
    dl.DataLoader = functools.partial(torch.utils.data.DataLoader, pin_memory=False)
    orig_init = tr.Trainer.__init__

    def __init__(self, *a, **k):
        orig_init(self, *a, **k)
        self.device_type = "cpu"

    # device_type is read only during steps, after __init__ returns
    tr.Trainer.__init__ = __init__


def base_argv(a: argparse.Namespace, save_path: Path, extra: list[str]) -> list[str]:
    conv = json.loads((Path(a.data) / "eyas_conversion.json").read_text())
    argv = [
        "--verifier-name-or-path",
        str(a.verifier),
        "--data-path",
        str(a.data),
        "--save-path",
        str(save_path),
        "--draft-vocab-size",
        str(conv["draft_vocab_size"]),
        "--target-layer-ids",
        *[str(i) for i in conv["aux_layers"]],
        "--log-dir",
        str(save_path / "logs"),
        "--num-workers",
        str(a.num_workers),
    ]
    if a.ttt_steps is not None:
        argv += ["--ttt-steps", str(a.ttt_steps)]
    if a.cpu:
        # flex attention needs the compiled GPU path, the fused loss needs Triton
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    return argv + list(extra)


def run_once(argv: list[str], budget_s: float | None, cpu: bool) -> Probe:
    import speculators.train.trainer as tr
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    saved = {
        n: getattr(tr.Trainer, n)
        for n in ("__init__", "train_epoch", "val_epoch", "maybe_save_checkpoint", "run_training")
    }
    probe = Probe()
    instrument(probe, budget_s, cpu)
    try:
        main(TrainConfig.resolve(argv))
    finally:
        restore(saved)
    return probe


def plan(budget_s: float, p: dict, margin: float = 0.97) -> dict:
    """The most steps that fit in the budget with their validation epochs and checkpoints; as
    ``--epochs`` (rounded up) plus ``--max-steps`` when that is not a whole number of epochs, so
    its LR schedule (which decays over ``--max-steps`` when set) ends with the budget.

    Whole epochs only, as before run d, left speculators 16 s of its 90 (RESULTS.md, run d)."""
    step = p["step_s_median"] or p["first_step_s"]  # one probe step (tiny data): its own time
    spe = p["steps_per_epoch"]
    if not step or not spe:
        raise RuntimeError(f"the probe recorded no steps ({p}); cannot plan the budget")
    vals = p["val_s"]
    val = vals[-1] if vals else 0.0  # the steady one (the first compiles), see the docstring
    ckpt = max(p["ckpt_s"]) if p["ckpt_s"] else 0.0
    # the budget starts after the first step (compilation), so only steady steps count
    avail = budget_s * margin
    allowance = max(0.0, vals[0] - vals[-1]) if len(vals) >= 2 else 0.0

    def cost(n: int) -> float:  # every started epoch ends with a validation and a checkpoint
        return n * step + math.ceil(n / spe) * (val + ckpt)

    n = int(avail // step)
    while n > 1 and cost(n) > avail:
        n -= 1
    n = max(1, n)
    return {
        "epochs": math.ceil(n / spe),
        "max_steps": n if n % spe else None,
        "expected_s": cost(n),
        "allowance_s": allowance,
    }


def final_checkpoint(save_path: Path) -> Path | None:
    """The interrupted checkpoint if the budget cut the run, else the highest epoch."""
    if (save_path / "interrupted" / "config.json").is_file():
        return save_path / "interrupted"
    epochs = [
        d
        for d in save_path.iterdir()
        if d.is_dir() and not d.is_symlink() and d.name.isdigit() and (d / "config.json").is_file()
    ]
    return max(epochs, key=lambda d: int(d.name)) if epochs else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description="speculators 0.9.0 EAGLE-3 trainer under a wall-clock budget")
    ap.add_argument("--verifier", required=True, help="Target HF directory.")
    ap.add_argument("--data", required=True, help="Output of to_speculators.py.")
    ap.add_argument("--out", required=True, help="Run directory (probe/, run/, spec_train.json).")
    ap.add_argument("--budget-s", type=float, required=True, help="Wall-clock budget of the run.")
    ap.add_argument("--probe-steps", type=int, default=30, help="0: no probe, use --epochs/--max-steps.")
    ap.add_argument("--epochs", type=int, default=None, help="With --probe-steps 0 only.")
    ap.add_argument("--max-steps", type=int, default=None, help="With --probe-steps 0 only.")
    ap.add_argument(
        "--allowance-s",
        type=float,
        default=0.0,
        help="With --probe-steps 0: timer seconds beyond the budget for the first validation's "
        "compilation (a probe measures it).",
    )
    ap.add_argument("--ttt-steps", type=int, default=None, help="Default: speculators' own (3).")
    ap.add_argument("--num-workers", type=int, default=8, help="Its dataloader workers (its default 12).")
    ap.add_argument("--cpu", action="store_true", help="Tests only: run without an accelerator.")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"budget_s": a.budget_s, "extra_args": extra, "ttt_steps": a.ttt_steps}
    t0 = time.perf_counter()
    if a.probe_steps > 0:
        probe_dir = out / "probe"
        pa = base_argv(a, probe_dir, extra) + ["--epochs", "2", "--max-steps", str(a.probe_steps)]
        p = run_once(pa, None, a.cpu).summary()
        p["wall_s"] = time.perf_counter() - t0
        result["probe"] = p
        result["plan"] = plan(a.budget_s, p)
    else:
        result["plan"] = {
            "epochs": a.epochs,
            "max_steps": a.max_steps,
            "expected_s": None,
            "allowance_s": a.allowance_s,
        }
    run_dir = out / "run"
    ra = base_argv(a, run_dir, extra)
    if result["plan"]["epochs"] is not None:
        ra += ["--epochs", str(result["plan"]["epochs"])]
    if result["plan"]["max_steps"] is not None:
        ra += ["--max-steps", str(result["plan"]["max_steps"])]
    t1 = time.perf_counter()
    probe = run_once(ra, a.budget_s + result["plan"]["allowance_s"], a.cpu)
    s = probe.summary()
    s["setup_s"] = (probe.run_start - t1) if probe.run_start else None
    s["wall_s"] = time.perf_counter() - t1
    result["run"] = s
    ck = final_checkpoint(run_dir)
    result["checkpoint"] = str(ck) if ck else None
    result["argv"] = ra
    tmp = out / "spec_train.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "spec_train.json")
    print(json.dumps({k: result[k] for k in ("plan", "checkpoint")} | {"run_loop_s": s["loop_s"], "steps": s["steps"]}))
    if ck is None:
        print("spec_train: no checkpoint was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
