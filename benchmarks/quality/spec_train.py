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
checkpoint directory to evaluate, also where the trainer fails (a SIGTERM to the whole process
group kills its data loader's workers, and the loader's error then ends the run or the interrupt
save, which speculators logs and passes over; run_quality signals the leader alone for this
reason): then ``"error"`` says why, the checkpoint is the interrupt save where it returned whole,
else the last ``--keep-saves`` copy (null without one), and the exit status is 1.

A run can span sessions (speculators_resume.md, section 5); none of this is on by default:
- ``--save-every-s S``: at the first step boundary S seconds after the first step or the last
  save, a numbered checkpoint ``run/<epoch>/`` with its ``training_state.json``, which
  speculators resumes from (also mid-epoch), unlike SIGTERM's ``interrupted/``.
- ``--stop-after-s S``: at the first step boundary S seconds after this session's first step,
  such a checkpoint, then the run stops (the script's own exception, not SIGTERM). The plan's
  last step never stops. ``spec_train.json["stopped"]`` says where (epoch, local and global
  step); it is null when the trainer returned (finished, or cut by the budget timer).
- ``--resume``: continues the stopped run in ``OUT``: its plan (no probe), extra flags and
  ``--ttt-steps``, the budget left (``--budget-s`` minus every earlier session's
  ``after_first_step_s``; the timer gets the allowance again, its validation compiles again),
  the same ``run/``, after removing a stale ``run/interrupted``. The earlier sessions' records
  move to ``"sessions"``; ``ckpt_at`` times continue the budget clock. A ``--resume`` of a run
  that was not stopped does nothing.
- ``--probe-from FILE``: no probe; the plan comes from an earlier ``spec_train.json`` of the same
  data on the same GPU kind (its run's measured steps, validations and saves, else its probe's):
  a probe's cold first step is most of its time (benchmarks/gpu_job.md, session 24).
  The record keeps the file (``probe_from``) and both runs' steps per epoch, which differ by
  more than their packing's variation where the data does (a warning then).
- ``--fp32-checkpoints``: its checkpointer saves in fp32 rather than bf16 (2x the size) so that a
  resume is exact (the trainer keeps fp32 weights and optimizer state).
- ``--keep-saves``: a copy of each numbered save's weights and config in ``OUT/kept/step-<global
  step>/`` (``ckpt_at[].kept``), for the tau curve: a mid-epoch save overwrites its epoch's
  directory in place. The copies are made inside the budget's clock.
The stop is decided in each process on its own clock: single-process runs only (as run_quality
starts it), not torchrun.

``--cpu`` (tests on machines without an accelerator only): 0.9.0's trainer moves the model to
device index 0, pins memory unconditionally and loads a resumed checkpoint to "cuda:0"; the flag
makes it use the CPU instead. Nothing else is changed.

Usage (speculators importable, e.g. PYTHONPATH with the carried wheels):
    python spec_train.py --verifier T --data D --out O --budget-s 120 [--probe-steps 30]
        [--ttt-steps N] [--save-every-s S] [--stop-after-s S] [--fp32-checkpoints]
        [-- extra speculators flags]
    python spec_train.py --verifier T --data D --out O --resume [--stop-after-s S]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
        # --stop-after-s: where the run stopped ({"epoch", "local_step", "global_step", ...}), or None
        self.stopped: dict | None = None
        self.last_save: float | None = None  # perf_counter at the end of the last numbered save
        # budget seconds spent by earlier sessions of a resumed run: ckpt_at's times continue them
        self.clock_offset_s = 0.0
        self.error: str | None = None  # what ended the trainer, where it did not return

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
            "error": self.error,
        }


class SessionStop(Exception):
    """Raised from the step callback after --stop-after-s's checkpoint; caught in run_once."""


class Session:
    """What a run does beyond the plain budget run; all off by default."""

    def __init__(
        self,
        save_every_s: float | None = None,
        stop_after_s: float | None = None,
        fp32: bool = False,
        keep_dir: Path | None = None,
    ) -> None:
        self.save_every_s = save_every_s
        self.stop_after_s = stop_after_s
        self.fp32 = fp32
        # --keep-saves: each numbered save's weights copied here (a mid-epoch save overwrites its
        # epoch's directory in place, so the curve's checkpoints would otherwise be lost)
        self.keep_dir = keep_dir


def instrument(probe: Probe, budget_s: float | None, cpu: bool, session: Session | None = None) -> None:
    """Wrap speculators' Trainer methods to time them (and arm the budget timer; with a
    ``session``, save numbered checkpoints on a clock, stop cleanly, save in fp32)."""
    import speculators.train.trainer as tr

    session = session or Session()
    T = tr.Trainer
    orig = {n: getattr(T, n) for n in ("__init__", "train_epoch", "val_epoch", "maybe_save_checkpoint", "run_training")}

    def __init__(self, *a, **k):
        probe.trainer = self
        orig["__init__"](self, *a, **k)
        if session.fp32:
            _fp32_checkpoints(self)

    def train_epoch(self, epoch, *, step_callback=None):
        # the epoch's local step, as the trainer counts it (1-based over the full epoch, a resumed
        # epoch's skipped batches included); read before the original clears _resume_local_step
        skip = getattr(self, "_resume_local_step", 0) if epoch == getattr(self, "current_epoch", epoch) else 0
        n0, cfg, num_steps = self.global_step, self.config, None
        if session.stop_after_s is not None or session.save_every_s is not None:
            # the epoch's batch count varies with the epoch (packing): set it first, as the
            # original does, and count before its resume skip slices the sampler's batch list
            if hasattr(self.train_loader.batch_sampler, "set_epoch"):
                self.train_loader.batch_sampler.set_epoch(epoch)
            num_steps = len(self.train_loader)

        def cb():
            now = time.perf_counter()
            probe.steps.append(now)
            if len(probe.steps) == 1:
                probe.last_save = now
                if budget_s is not None:
                    # the budget runs from the end of the first step: compilation and warm-up are
                    # not counted (eyas's runs are planned the same way, from steady step times)
                    timer = threading.Timer(budget_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
                    timer.daemon = True
                    timer.start()
                    probe.timer = timer
            if session.stop_after_s is not None or session.save_every_s is not None:
                # after the optimizer, the scheduler and global_step += 1: a consistent boundary
                local_step = skip + self.global_step - n0
                last = (cfg.max_steps is not None and self.global_step >= cfg.max_steps) or (
                    epoch == cfg.num_epochs - 1 and local_step >= num_steps
                )
                # the plan's last step: the trainer saves and validates next anyway, and a resume
                # from a mid-epoch state at max_steps would run one step more than planned
                if not last:
                    stop = session.stop_after_s is not None and now - probe.steps[0] >= session.stop_after_s
                    due = session.save_every_s is not None and now - probe.last_save >= session.save_every_s
                    if stop or due:
                        self.maybe_save_checkpoint(epoch, local_step=local_step)
                    if stop:
                        probe.stopped = {
                            "epoch": epoch,
                            "local_step": local_step,
                            "global_step": self.global_step,
                            "after_first_step_s": time.perf_counter() - probe.steps[0],
                            "checkpoint": str(self.checkpointer.path / str(epoch)),
                        }
                        raise SessionStop(f"stopped after {session.stop_after_s} s at {probe.stopped}")
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
        at = {
            "epoch": str(epoch),
            # a resumed session's save before its first step (the end of the epoch it stopped at
            # the end of) is at the budget clock's time so far
            "after_first_step_s": (probe.clock_offset_s + t - probe.steps[0])
            if probe.steps
            else (probe.clock_offset_s or None),
        }
        if session.save_every_s is not None or session.stop_after_s is not None or probe.clock_offset_s:
            at |= {"local_step": local_step, "global_step": self.global_step}
        probe.ckpt_at.append(at)
        saved = False
        try:
            out = orig["maybe_save_checkpoint"](self, epoch, local_step=local_step)
            saved = True
            return out
        except BaseException as e:
            if epoch == "interrupted":
                # speculators logs and swallows this failure (e.g. torch's SIGCHLD handler raising
                # in the save when a group SIGTERM killed a loader worker): what it left is partial
                probe.error = f"the interrupt save failed: {type(e).__name__}: {e}"
                shutil.rmtree(self.checkpointer.path / "interrupted", ignore_errors=True)
            raise
        finally:
            probe.ckpt_s.append(time.perf_counter() - t)
            # only a save that returned: one cut by a failure may be partial
            if session.keep_dir is not None and epoch != "interrupted" and saved:
                at["kept"] = _keep(self.checkpointer.path / str(epoch), session.keep_dir / f"step-{self.global_step}")
            probe.last_save = time.perf_counter()
            if epoch == "interrupted":
                probe.interrupted = saved

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


def _keep(src: Path, dst: Path) -> str | None:
    """A copy of the weights and config of the checkpoint just saved in ``src`` (what evaluation
    reads; no optimizer state), or None where it saved nothing (not rank 0, or gated)."""
    if not (src / "config.json").is_file():
        return None
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and (f.suffix in (".json", ".safetensors")) and f.name != "training_state.json":
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return str(dst)


def _fp32_checkpoints(trainer) -> None:
    """Make this trainer's checkpointer save in fp32 (0.9.0 passes no float_dtype, so bf16): the
    weights and optimizer state it keeps in fp32 then come back exactly on a resume."""
    import torch

    save = trainer.checkpointer.save_checkpoint  # bound; keeps its rank-0-only decorator

    def save_checkpoint(model, optimizer, epoch, float_dtype=None):
        return save(model, optimizer, epoch, float_dtype=torch.float32)

    trainer.checkpointer.save_checkpoint = save_checkpoint


def restore(saved: dict) -> None:
    import speculators.train.trainer as tr

    for n, f in saved.items():
        setattr(tr.Trainer, n, f)


def _cpu_shims() -> None:
    """Let 0.9.0's trainer run without an accelerator (tests only): CPU device (also for loading a
    checkpoint on a resume), no pinned memory, no accelerator synchronisation in its step timer."""
    import functools

    import torch
    import torch.utils.data
    import speculators.train.checkpointer as ck
    import speculators.train.dataloader as dl
    import speculators.train.trainer as tr

    tr.get_local_rank = lambda: "cpu"
    ck.get_current_device = lambda: "cpu"  # where a resume loads its checkpoint to
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


def run_once(
    argv: list[str],
    budget_s: float | None,
    cpu: bool,
    session: Session | None = None,
    clock_offset_s: float = 0.0,
) -> Probe:
    import speculators.train.trainer as tr
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    saved = {
        n: getattr(tr.Trainer, n)
        for n in ("__init__", "train_epoch", "val_epoch", "maybe_save_checkpoint", "run_training")
    }
    probe = Probe()
    probe.clock_offset_s = clock_offset_s
    instrument(probe, budget_s, cpu, session)
    try:
        main(TrainConfig.resolve(argv))
    except SessionStop as e:
        print(f"spec_train: {e}", file=sys.stderr)
    except Exception as e:
        # e.g. a SIGTERM to the whole process group (a stop from outside: run_quality signals the
        # leader alone): the data loader's workers die with it and the trainer fails, mid-save or
        # not. The saves made so far still count
        probe.error = f"{type(e).__name__}: {e}"
        print(f"spec_train: the trainer failed: {probe.error}", file=sys.stderr)
    finally:
        restore(saved)
    return probe


def plan(budget_s: float, p: dict, margin: float = 0.97, save_every_s: float | None = None, stop: bool = False) -> dict:
    """The most steps that fit in the budget with their validation epochs and checkpoints; as
    ``--epochs`` (rounded up) plus ``--max-steps`` when that is not a whole number of epochs, so
    its LR schedule (which decays over ``--max-steps`` when set) ends with the budget.
    ``--save-every-s`` checkpoints and a ``--stop-after-s`` one are taken off the budget first.

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
    extra_saves = (int(avail // save_every_s) if save_every_s else 0) + (1 if stop else 0)
    avail -= extra_saves * ckpt
    allowance = max(0.0, vals[0] - vals[-1]) if len(vals) >= 2 else 0.0

    def cost(n: int) -> float:  # every started epoch ends with a validation and a checkpoint
        return n * step + math.ceil(n / spe) * (val + ckpt)

    n = int(avail // step)
    while n > 1 and cost(n) > avail:
        n -= 1
    n = max(1, n)
    out = {
        "epochs": math.ceil(n / spe),
        "max_steps": n if n % spe else None,
        "expected_s": cost(n),
        "allowance_s": allowance,
    }
    if extra_saves:
        out["extra_saves"] = extra_saves
        out["expected_s"] += extra_saves * ckpt
    return out


def measured(record: Path) -> tuple[dict, str]:
    """What ``plan`` needs from an earlier ``spec_train.json``: its run's timings where it ran
    steps (many steps, its first validation compiling), else its probe's; and which one."""
    try:
        sj = json.loads(Path(record).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"spec_train: --probe-from {record}: not a readable spec_train.json ({e})") from e
    for key in ("run", "probe"):
        rec = sj.get(key) or {}
        if rec.get("steps") and rec.get("steps_per_epoch") and (rec.get("step_s_median") or rec.get("first_step_s")):
            return rec, key
    raise SystemExit(f"spec_train: --probe-from {record}: neither its run nor its probe recorded steps to plan from")


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


def _previous(out: Path, a: argparse.Namespace, extra: list[str]) -> dict:
    """The stopped session's record that ``--resume`` continues; checks that this call matches it."""
    sj = out / "spec_train.json"
    if not sj.is_file():
        raise SystemExit(f"spec_train: --resume needs {sj} from the stopped session")
    prev = json.loads(sj.read_text())
    if extra and extra != prev["extra_args"]:
        raise SystemExit(f"spec_train: --resume: extra flags {extra} differ from the recorded {prev['extra_args']}")
    if a.ttt_steps is not None and a.ttt_steps != prev["ttt_steps"]:
        raise SystemExit(f"spec_train: --resume: --ttt-steps {a.ttt_steps} differs from the stopped session's")
    for k in ("epochs", "max_steps"):
        if getattr(a, k) is not None and getattr(a, k) != prev["plan"][k]:
            raise SystemExit(f"spec_train: --resume: --{k.replace('_', '-')} differs from the plan {prev['plan']}")
    return prev


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
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="Wall-clock budget of the whole run (required; with --resume the recorded one by default).",
    )
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
    ap.add_argument(
        "--probe-from",
        type=Path,
        default=None,
        help="Plan from this earlier spec_train.json (the same data and GPU kind) instead of probing.",
    )
    ap.add_argument("--ttt-steps", type=int, default=None, help="Default: speculators' own (3).")
    ap.add_argument("--num-workers", type=int, default=8, help="Its dataloader workers (its default 12).")
    ap.add_argument(
        "--save-every-s",
        type=float,
        default=None,
        help="Also save a numbered (resumable) checkpoint at the first step this many seconds after "
        "the first step or the last save.",
    )
    ap.add_argument(
        "--stop-after-s",
        type=float,
        default=None,
        help="End this session at the first step this many seconds after its first step: save a "
        "numbered checkpoint and stop (spec_train.json's 'stopped'); continue with --resume.",
    )
    ap.add_argument(
        "--fp32-checkpoints",
        action="store_true",
        help="Save checkpoints in fp32 instead of its bf16 (2x the size; a resume is then exact).",
    )
    ap.add_argument(
        "--keep-saves",
        action="store_true",
        help="Copy the weights of every numbered save to OUT/kept/step-<global step>/ (for the tau "
        "curve: a mid-epoch save overwrites its epoch's directory); ckpt_at names each copy ('kept').",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="Continue the run that --stop-after-s stopped in OUT: its plan, no probe, the rest of its budget.",
    )
    ap.add_argument("--cpu", action="store_true", help="Tests only: run without an accelerator.")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    prev = _previous(out, a, extra) if a.resume else None
    if prev is not None:
        if not prev.get("stopped"):
            print(f"spec_train: the run in {out} was not stopped by --stop-after-s; nothing to resume")
            return 0
        st = prev["stopped"]
        state = run_dir / str(st["epoch"]) / "training_state.json"
        if not state.is_file() or json.loads(state.read_text())["global_step"] != st["global_step"]:
            raise SystemExit(f"spec_train: --resume: {state} is missing or is not the stop's ({st})")
        extra, a.ttt_steps = prev["extra_args"], prev["ttt_steps"]
        a.fp32_checkpoints = a.fp32_checkpoints or prev.get("fp32_checkpoints", False)
        total = a.budget_s if a.budget_s is not None else prev["budget_s"]
        sessions = prev.get("sessions", []) + [
            {k: prev.get(k) for k in ("session_budget_s", "run", "stopped", "checkpoint", "argv") if k in prev}
        ]
        used = sum(x["run"]["after_first_step_s"] or 0.0 for x in sessions)
        if total - used <= 0:
            print(f"spec_train: --resume: no budget left ({used:.1f} s of {total} s used)", file=sys.stderr)
            return 1
        # a SIGTERM's interrupted/ is not resumable and would shadow this session's checkpoints
        shutil.rmtree(run_dir / "interrupted", ignore_errors=True)
        result: dict = {"budget_s": total, "extra_args": extra, "ttt_steps": a.ttt_steps}
        result |= {k: prev[k] for k in ("probe", "plan") if k in prev}
        result |= {"sessions": sessions, "session_budget_s": total - used, "resumed_from": st}
        session_budget, clock_offset = total - used, used
    else:
        if a.budget_s is None:
            ap.error("--budget-s is required")
        result = {"budget_s": a.budget_s, "extra_args": extra, "ttt_steps": a.ttt_steps}
        session_budget, clock_offset = a.budget_s, 0.0
    if a.fp32_checkpoints:
        result["fp32_checkpoints"] = True
    if prev is not None:  # the stopped session's saving goes on as it was
        a.keep_saves = a.keep_saves or prev.get("keep_saves", False)
        a.save_every_s = a.save_every_s if a.save_every_s is not None else prev.get("save_every_s")
    if a.keep_saves:
        result["keep_saves"] = True
    if a.save_every_s is not None:
        result["save_every_s"] = a.save_every_s
    session = Session(
        a.save_every_s, a.stop_after_s, a.fp32_checkpoints, (out / "kept").resolve() if a.keep_saves else None
    )
    t0 = time.perf_counter()
    if prev is not None:
        pass  # the stopped session's plan (in result): the same --epochs/--max-steps, the same LR schedule
    elif a.probe_from is not None:
        p, source = measured(a.probe_from)
        result["probe_from"] = {"file": str(a.probe_from), "record": source, "steps_per_epoch": p["steps_per_epoch"]}
        result["plan"] = plan(a.budget_s, p, save_every_s=a.save_every_s, stop=a.stop_after_s is not None)
    elif a.probe_steps > 0:
        probe_dir = out / "probe"
        # a leftover probe/ must not be resumed (resuming is the CLI's default): it would run 0 steps
        pa = base_argv(a, probe_dir, extra) + [
            "--epochs",
            "2",
            "--max-steps",
            str(a.probe_steps),
            "--no-resume-from-checkpoint",
        ]
        p = run_once(pa, None, a.cpu, Session(fp32=a.fp32_checkpoints)).summary()
        if p["error"]:
            print(f"spec_train: the probe failed ({p['error']}); nothing to plan from", file=sys.stderr)
            return 1
        p["wall_s"] = time.perf_counter() - t0
        result["probe"] = p
        result["plan"] = plan(a.budget_s, p, save_every_s=a.save_every_s, stop=a.stop_after_s is not None)
    else:
        result["plan"] = {
            "epochs": a.epochs,
            "max_steps": a.max_steps,
            "expected_s": None,
            "allowance_s": a.allowance_s,
        }
    ra = base_argv(a, run_dir, extra)
    if result["plan"]["epochs"] is not None:
        ra += ["--epochs", str(result["plan"]["epochs"])]
    if result["plan"]["max_steps"] is not None:
        ra += ["--max-steps", str(result["plan"]["max_steps"])]
    t1 = time.perf_counter()
    probe = run_once(ra, session_budget + result["plan"]["allowance_s"], a.cpu, session, clock_offset)
    s = probe.summary()
    s["setup_s"] = (probe.run_start - t1) if probe.run_start else None
    s["wall_s"] = time.perf_counter() - t1
    result["run"] = s
    if "probe_from" in result:
        result["probe_from"]["steps_per_epoch_now"] = s["steps_per_epoch"]
        # its packing makes an epoch's batch count vary slightly between runs of the same data;
        # more than that is other data
        was, now = result["probe_from"]["steps_per_epoch"], s["steps_per_epoch"]
        if now is None or abs(now - was) > 0.1 * was:
            print(
                f"spec_train: --probe-from {a.probe_from}: {was} steps an epoch there, {now} here: "
                "not the same data, so the plan may miss the budget",
                file=sys.stderr,
            )
    # null: the trainer returned (finished, or cut by the budget timer); else where it stopped
    result["stopped"] = probe.stopped
    if probe.error is None:
        ck = final_checkpoint(run_dir)
    else:
        # a save under way when the trainer failed may be partial; the interrupt save where it
        # returned before the failure and a kept copy (made by rename) are whole
        result["error"] = probe.error
        kept = [c["kept"] for c in probe.ckpt_at if c.get("kept")]
        ck = run_dir / "interrupted" if probe.interrupted else Path(kept[-1]) if kept else None
        print(f"spec_train: the run failed; its draft is its last whole save: {ck}", file=sys.stderr)
    result["checkpoint"] = str(ck) if ck else None
    result["argv"] = ra
    tmp = out / "spec_train.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "spec_train.json")
    line = {k: result[k] for k in ("plan", "checkpoint")} | {"run_loop_s": s["loop_s"], "steps": s["steps"]}
    if probe.stopped:
        line["stopped"] = probe.stopped
    print(json.dumps(line))
    if ck is None:
        print("spec_train: no checkpoint was written", file=sys.stderr)
        return 1
    return 1 if probe.error else 0


if __name__ == "__main__":
    sys.exit(main())
