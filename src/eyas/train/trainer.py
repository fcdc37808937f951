"""`eyas train`: the EAGLE-3 draft trained with training-time test (TTT).

One process (CPU or one GPU) or many under ``torchrun`` (DDP or FSDP2, ``--parallel``; gloo on CPU,
NCCL on GPU; see :mod:`eyas.train.parallel`). The
global batch is ``world_size * grad_accum * batch_size`` packs; micro-batch m of a step goes to
rank ``m % world``, so a run's numbers do not depend on how the global batch is split.
Every ``save_every`` steps a checkpoint holds model, optimizer, scheduler, RNG and the step
(which fixes the data position: pack order is a pure function of seed and epoch).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from eyas.draft import flex
from eyas.draft.fused_loss import fused_ttt_loss
from eyas.draft.fused_loss import positions as fused_positions
from eyas.draft.loss import TargetHead, soft_cross_entropy, ttt_loss
from eyas.draft import io as draft_io
from eyas.draft.io import check_finite_state
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.device import device_name
from eyas.errors import EyasError, EyasWarning
from eyas.fsio import atomic_write_text
from eyas.train import checkpoint as ckpt
from eyas.train.budget import BudgetPlanner, TrainClock, many_passes
from eyas.train.guard import NonFiniteGuard
from eyas.train.metrics import Logger, StepClock, StepLog, plot_losses, plot_tau
from eyas.train import optim as optim_mod
from eyas.train import parallel
from eyas.train.config import TrainConfig
from eyas.train.packing import EpochPlan, pack_indices, split_indices
from eyas.train.stall import StallWatch
from eyas.train.stop import StopRequest
from eyas.train.tau import TAU_FILE, TAU_KEYS

# The step count of a --budget run before its plan: no end (the plan sets one).
UNPLANNED = 1 << 62
# Under torchrun, the budget's plan and the tau timing are decided on rank 0's clock and shared every
# this many steps (one host sync each; a single process decides after every step without one).
DECIDE_EVERY = 10

# Fields that must match between a run and its resume (they fix the data order and the objective).
# Checkpoint keys (on disk), not setting names: "heldout_fraction" is the --heldout of the run.
RESUME_KEYS = (
    "target_id",
    "dataset_id",
    "tokens_per_batch",
    "batch_size",
    "global_micro",
    "seed",
    "ttt_steps",
    "heldout_fraction",
    "aux_layers",
    "optimizer",
)


# ------------------------------------------------------------------------------ training


def autocast_dtype(device: torch.device | str, precision: str) -> torch.dtype | None:
    """bf16 for bf16 autocast, None for plain fp32."""
    if precision == "auto":
        precision = "bf16" if torch.device(device).type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext


def feature_kind(cfg: TrainConfig) -> str:
    """--features: offline, online or vllm (refused when not given, before the target loads)."""
    if cfg.features is None:
        raise EyasError(
            "pass exactly one feature source with --features: offline (with --store STORE, from "
            "`eyas extract`), online (the target runs in the training job; --online for short) or "
            "vllm (a vLLM engine makes them as training goes)"
        )
    return cfg.features


def build_source(cfg: TrainConfig, target, dataset, device: torch.device, dist: parallel.Dist | None = None):
    from eyas.train.features import OfflineFeatures, OnlineFeatures

    # bf16 features on GPU, except for --precision fp32 (the draft's fp32 fc would meet bf16 input)
    feat_dtype = torch.bfloat16 if device.type == "cuda" and cfg.precision != "fp32" else torch.float32
    kind = feature_kind(cfg)
    if kind == "vllm":
        from eyas.train.stream import StreamFeatures

        dist = dist or parallel.Dist()
        return StreamFeatures(
            cfg,
            target,
            dataset,
            device,
            feat_dtype,
            cfg.tokens_per_batch,
            rank=dist.rank,
            world=dist.world,
            local_rank=dist.local_rank,
        )
    if kind == "online":
        return OnlineFeatures(target, dataset, cfg.layers, device, feat_dtype, cfg.tokens_per_batch)
    return OfflineFeatures(cfg.store, target, dataset, cfg.layers, device, feat_dtype, cfg.tokens_per_batch)


def _reduce_stats(stats_list, dist: parallel.Dist, device) -> torch.Tensor:
    """[3, K] (loss_sum, correct, count) summed over micro-batches and ranks."""
    t = torch.stack([torch.stack([s.loss_sum, s.correct, s.count]) for s in stats_list], dim=1).to(device)
    return dist.all_sum(t)


class Trainer:
    """One training run: ``__init__`` builds its components, :meth:`train` runs the loop, one
    :meth:`train_step` at a time (components: :mod:`parallel <eyas.train.parallel>`,
    :mod:`checkpoint <eyas.train.checkpoint>`, :mod:`metrics <eyas.train.metrics>`,
    :mod:`guard <eyas.train.guard>`, :mod:`optim <eyas.train.optim>`, :mod:`packing <eyas.train.packing>`)."""

    def __init__(self, cfg: TrainConfig):
        from eyas.data.dataset import open_prepared
        from eyas.target import resolve_target

        self.t_start = time.perf_counter()
        self.dist, self.device = parallel.setup_dist(cfg.device)
        # unset --compile / --fused-loss: the measured fast, correct configuration on CUDA
        # (benchmarks/numerics/README.md), today's eager loss on the CPU
        on_cuda = self.device.type == "cuda"
        # unset --optimizer / --batch-size: the recipe measured best (benchmarks/recipe/README.md):
        # Muon (AdamW under FSDP2, which shards the matrices Muon orthogonalises), 8 packs a step on CUDA
        sharded = cfg.parallel == "fsdp2" and self.dist.on
        self.cfg = cfg = replace(
            cfg,
            compile=on_cuda if cfg.compile is None else cfg.compile,
            fused_loss=on_cuda if cfg.fused_loss is None else cfg.fused_loss,
            optimizer=cfg.optimizer or ("adamw" if sharded else "muon"),
            batch_size=cfg.batch_size or (8 if on_cuda else 1),
        )
        if on_cuda or cfg.compile:
            # inductor's and Triton's caches (flex attention is compiled on every CUDA run) under eyas's
            # cache: a second run of the same shapes reuses the first one's kernels and graphs
            from eyas.cache import cache_dir

            os.environ.setdefault(
                "TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "compile" / f"torch-{torch.__version__}")
            )
        self.attention = flex.resolve(cfg.attention, self.device, backward=True)
        self.run_dir, self.is_main = Path(cfg.out), self.dist.rank == 0
        if self.attention == "flex" and cfg.tokens_per_batch % flex.TILE and self.is_main:
            warnings.warn(
                f"--tokens-per-batch {cfg.tokens_per_batch} is not a multiple of {flex.TILE}: flex's "
                "block masks are then built by a compiled create_block_mask, which can take minutes on a "
                f"cold cache (benchmarks/compile_time.md); use a multiple of {flex.TILE}",
                category=EyasWarning,
                stacklevel=1,
            )
        target = resolve_target(cfg.target)
        dataset = open_prepared(cfg.data, target=target)
        self.source = build_source(cfg, target, dataset, self.device, self.dist)
        self._plan_data(target, dataset)
        resumed = self._build_model(target, dataset)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
        self._build_step()
        state = resumed["trainer"] if resumed else {}
        self.clock = TrainClock(float(state.get("steps_s", 0.0)))  # a resumed budget goes on where it was
        self.plan_info: dict[str, Any] = dict(state.get("budget_plan") or {})
        cap = None if self.total == UNPLANNED or self.lr_schedule.planned_at is not None else self.total
        self.planner = BudgetPlanner(cfg.budget, cap) if cfg.budget else None
        self.devices = f"{self.dist.world} x {device_name(str(self.device))}"
        if self.planner and self.planner.resumed_elsewhere(self.lr_schedule, state.get("devices"), self.devices):
            self.plan_info["resumed_elsewhere"] = {"at_step": self.start, "from": state["devices"], "on": self.devices}
            if self.is_main:
                print(
                    f"eyas train: resumed on {self.devices}, not {state['devices']} as checkpointed: "
                    "the budget's end is planned again at this machine's pace",
                    file=sys.stderr,
                    flush=True,
                )
        self._warned_passes = False
        self.tau_probe = self._build_tau_probe(target)
        # the first --tau-every mark past the steps' seconds so far (a resumed run's included)
        self.next_tau_s = cfg.tau_every and (self.clock.offset // cfg.tau_every + 1) * cfg.tau_every
        self.logger = Logger(self.run_dir, self.start, self.is_main)
        self.log = StepLog(
            self.logger,
            self.guard,
            StepClock(self.device),
            None if self.total == UNPLANNED else self.total,
            cfg.log_every,
            self.global_micro,
            int(resumed["trainer"].get("tokens_seen", 0)) if resumed else 0,
            self.start,
            self.t_start,
            self.is_main and cfg.progress,
        )
        if hasattr(self.source, "start"):  # --features vllm: the engine is fed this run's calls, in order
            self.source.start(self.planned_calls())

    def _plan_data(self, target, dataset) -> None:
        """The epoch plan (pack order is a pure function of seed and epoch, so a step fixes the data
        position), the held-out packs, the planned steps and what a resume must match."""
        cfg = self.cfg
        self.global_micro = self.dist.world * cfg.grad_accum
        train_idx, held_idx = split_indices(len(dataset), cfg.heldout)
        self.plan = EpochPlan(
            train_idx, dataset.lengths, cfg.tokens_per_batch, cfg.batch_size, self.global_micro, cfg.seed
        )
        if cfg.max_steps is not None:
            self.total = cfg.max_steps
        elif cfg.budget is not None and cfg.epochs is None:
            self.total = UNPLANNED  # as many epochs as the budget takes
        else:
            self.total = sum(self.plan.steps_in(e) for e in range(cfg.epochs or 1))
        if self.total <= 0 or self.plan.steps_in(0) == 0:
            raise EyasError(
                f"dataset {cfg.data}: {len(train_idx)} training samples make "
                f"{len(self.plan.packs(0))} packs of {cfg.tokens_per_batch} tokens, fewer than one "
                f"global batch of {cfg.batch_size * self.global_micro}; lower --tokens-per-batch or "
                "--grad-accum, or add data"
            )
        self.held_packs = pack_indices(held_idx, dataset.lengths, cfg.tokens_per_batch, seed=None)
        # answers' loops left out of the loss (eyas prepare --mask-loops): the many-passes warning's hint
        self._masked_loops = bool((dataset.manifest.get("settings") or {}).get("mask_loops"))
        self._skipped_leading = int(
            ((dataset.manifest.get("counts") or {}).get("dropped") or {}).get("starts_with_assistant", 0)
        )
        self.run_info = {
            "target_id": target.id,
            "dataset_id": dataset.manifest.get("id"),
            "tokens_per_batch": cfg.tokens_per_batch,
            "batch_size": cfg.batch_size,
            "global_micro": self.global_micro,
            "seed": cfg.seed,
            "ttt_steps": cfg.ttt_steps,
            "heldout_fraction": cfg.heldout,
            "aux_layers": list(self.source.aux_layers),
            "optimizer": cfg.optimizer,
        }
        too_long = int((dataset.lengths > cfg.tokens_per_batch).sum())
        if too_long and self.is_main:
            warnings.warn(
                f"{too_long} of {len(dataset)} samples are longer than --tokens-per-batch "
                f"{cfg.tokens_per_batch} and are cut to it (their tails, often assistant tokens, are "
                "not trained on); use --tokens-per-batch >= the dataset's max_length "
                f"({dataset.manifest.get('max_length')}) to keep them whole",
                category=EyasWarning,
                stacklevel=1,
            )

    def _build_model(self, target, dataset) -> dict[str, Any] | None:
        """The draft (fresh, or from the newest checkpoint that reads back whole), the target's head,
        the parallel wrapper, optimizer, schedule and guard; returns the checkpoint resumed, if any."""
        cfg, dist, device = self.cfg, self.dist, self.device
        d2t, t2d = dataset.draft_vocab()
        tcfg = target.config()
        existing = ckpt.checkpoint_dirs(self.run_dir)
        if existing and not cfg.resume:
            raise EyasError(
                f"run directory {self.run_dir} already has checkpoints (latest {existing[-1].name}); "
                "pass --resume to continue it, or choose a new --out"
            )
        resumed = ckpt.load_latest(self.run_dir, dist.rank) if (existing and cfg.resume) else None
        self.draft_cfg = DraftConfig.from_target(
            tcfg,
            self.source.aux_layers,
            int(d2t.numel()),
            target.identity,
            target_name_or_path=str(target.path),
            target_spec=target.spec,
            **cfg.draft_config,
        )
        if resumed:
            self._check_resume(resumed)
            self.draft_cfg = DraftConfig.from_dict(resumed["config"])
            model = Eagle3Draft(self.draft_cfg)
            draft_io.load_state(model, resumed["model"], f"checkpoint {resumed['path']}", target.path)
        else:
            model = Eagle3Draft.from_target(self.draft_cfg, target.path, d2t, t2d, seed=cfg.seed)
        self.model = model.to(device)
        eps = float(tcfg.get("text_config", tcfg).get("rms_norm_eps", 1e-6))
        self.head = TargetHead.from_target(target.path, d2t, eps).to(device)
        # wrap first: FSDP2 turns the parameters into shards, and the optimizer must hold those
        self.net = parallel.wrap(model, cfg.parallel, dist.world, device, fused_loss=cfg.fused_loss)
        self.sharded = parallel.is_fsdp(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optim = optim_mod.build(
            model, cfg.optimizer, cfg.lr, cfg.betas, cfg.weight_decay, fused=device.type == "cuda", sharded=self.sharded
        )
        # a --budget run holds at the peak after warmup until its plan sets the end
        self.lr_schedule = optim_mod.Schedule(
            cfg.schedule,
            cfg.warmup,
            self.total,
            cfg.min_lr_ratio,
            cfg.decay_fraction,
            self.total if cfg.budget else None,
        )
        self.sched = optim_mod.schedule(self.optim, self.lr_schedule)
        self.guard = NonFiniteGuard(self.optim, cfg.max_nonfinite_steps)
        self.start = 0
        if resumed:
            parallel.load_optim_state(model, self.optim, resumed["optimizer"])
            self.sched.load_state_dict(resumed["scheduler"])  # with a --budget run's plan
            if self.lr_schedule.planned_at is not None:
                self.total = self.lr_schedule.total
            else:  # the checkpoint's state holds its run's length: decay to this run's end instead
                self.lr_schedule.total = self.total
                optim_mod.reapply(self.sched, self.lr_schedule)
            ckpt.check_resume_step(resumed, self.total)
            self.start = int(resumed["trainer"]["step"])
            if resumed["rng"] is not None:
                ckpt.set_rng_state(resumed["rng"])
        else:
            torch.manual_seed(cfg.seed + dist.rank)
        return resumed

    def _build_step(self) -> None:
        """What runs a batch: the compiled or eager forward, the loss, autocast."""
        cfg = self.cfg
        if cfg.compile and cfg.compile_scope == "regions":
            self.model.compile_regions()  # per TTT step, not the whole unroll: compile time independent of the steps
        self.fwd = self.net
        if cfg.compile and cfg.compile_scope == "model":
            self.fwd = torch.compile(self.net, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
        # the loss's [tokens, draft_vocab] fp32 passes are most of a step's memory traffic; compiled, one
        # fused reduction (dynamic: each TTT step scores a different number of positions)
        self.ce = torch.compile(soft_cross_entropy, dynamic=True) if cfg.compile else soft_cross_entropy
        self.matmul_dtype = autocast_dtype(self.device, cfg.precision)  # also the fused loss's lm_head dtype
        self.autocast = _autocast(self.device, self.matmul_dtype)

    def _build_tau_probe(self, target):
        """The --tau probe on rank 0 (default: on where the target is in this job on a GPU)."""
        cfg = self.cfg
        on = cfg.tau if cfg.tau is not None else (feature_kind(cfg) == "online" and self.device.type == "cuda")
        if not on:
            return None
        if self.sharded:
            if cfg.tau:
                raise EyasError(
                    "--tau with --parallel fsdp2: the draft's weights are sharded over the ranks, and "
                    "the replay runs on one; use --parallel ddp, or --no-tau and `eyas evaluate`"
                )
            return None
        if not self.is_main:
            return None
        from eyas.train.tau import TauProbe

        return TauProbe(cfg, target, getattr(self.source, "model", None), self.device, cfg.progress)

    def _check_resume(self, resumed: dict[str, Any]) -> None:
        old = resumed["trainer"]["run"]
        diffs = [
            f"{k}: {old.get(k)!r} there, {self.run_info[k]!r} now"
            for k in RESUME_KEYS
            if old.get(k) != self.run_info[k]
        ]
        if diffs:
            # a dataset prepared again elsewhere can differ by a token (other tokenizer versions)
            data = (
                ". The prepared data differ from the checkpoint's: resume with the dataset it trained on "
                "(copy that --data directory with the run), not one prepared again"
                if old.get("dataset_id") != self.run_info["dataset_id"]
                else ""
            )
            raise EyasError(
                f"cannot resume {resumed['path']}: "
                + "; ".join(diffs)
                + data
                + ". Resume with the same settings, or start a new --out"
            )

    # ------------------------------------------------------------------ data

    def micro_packs(self, step: int, a: int, plan: EpochPlan | None = None) -> tuple[int, list[list[int]]]:
        """(epoch, packs) of micro-batch ``a`` of optimizer step ``step`` on this rank (from ``plan``, by
        default the run's own)."""
        plan = plan or self.plan
        epoch, off = plan.locate(step)
        m = off * self.global_micro + a * self.dist.world + self.dist.rank
        return epoch, plan.packs(epoch)[m * self.cfg.batch_size : (m + 1) * self.cfg.batch_size]

    def micro_batches(self, step: int):
        for a in range(self.cfg.grad_accum):
            epoch, packs = self.micro_packs(step, a)
            nxt = (step, a + 1) if a + 1 < self.cfg.grad_accum else (step + 1, 0)
            if nxt[0] < self.total:
                self.source.prefetch(self.micro_packs(*nxt)[1])  # read ahead while this one trains
            yield a, epoch, packs

    def heldout_calls(self) -> list[tuple[int, list[list[int]]]]:
        """(held-out chunk number, packs) of each forward one evaluation runs on this rank, in order (a
        number past the end is a rerun of chunk 0 whose counts are dropped: FSDP2's forward is collective,
        so every rank runs the same number)."""
        cfg, dist = self.cfg, self.dist
        chunks = [self.held_packs[i : i + cfg.batch_size] for i in range(0, len(self.held_packs), cfg.batch_size)]
        chunks = chunks[: cfg.eval_batches]
        if not chunks:
            return []
        if self.sharded:
            rounds = -(-len(chunks) // dist.world)
            idx = [i * dist.world + dist.rank for i in range(rounds)]
        else:
            idx = list(range(dist.rank, len(chunks), dist.world))
        return [(i, chunks[i if i < len(chunks) else 0]) for i in idx]

    def planned_calls(self):
        """(name, packs) of every batch this rank will ask its feature source for, in order, from the
        resumed step on: the micro-batches of each step and the held-out batches of each evaluation
        (names from :func:`eyas.train.stream.unit_name`, which sort in this order). A run stopped early
        by a failure leaves the plan before its end."""
        from eyas.train.stream import unit_name

        cfg, held = self.cfg, self.heldout_calls()
        # a plan of its own: the feeder thread walks it ahead of the loop, and EpochPlan's cache of
        # epochs is not shared between threads
        p = self.plan
        plan = EpochPlan(p.train_idx, p.lengths, p.budget, p.batch, p.global_micro, p.seed)
        for step in range(self.start, self.total):
            for a in range(cfg.grad_accum):
                yield unit_name(step, 0, a), self.micro_packs(step, a, plan)[1]
            done = step + 1
            if (cfg.eval_every and done % cfg.eval_every == 0 and done < self.total) or done == self.total:
                for k, (_, packs) in enumerate(held):
                    yield unit_name(step, 1, k), packs

    # ------------------------------------------------------------------ one batch, one step

    def forward_loss(self, packs: list[list[int]], grad: bool) -> tuple[torch.Tensor, list, int]:
        """(loss, per-TTT-step stats, real tokens) of one micro-batch."""
        cfg = self.cfg
        batch = self.source.batch(packs)
        # the fused loss's positions from the host's copy of the layout, before the forward is
        # queued: found on the device, they would wait for it
        scored = (
            fused_positions(batch.layout.loss_mask, batch.layout.doc_ids, cfg.ttt_steps) if cfg.fused_loss else None
        )
        # built here, outside the compiled forward: inside its graph they made flex compute wrong
        # attention on CUDA (flex.ttt_block_masks)
        masks = flex.ttt_block_masks(batch.doc_ids, cfg.ttt_steps) if self.attention == "flex" else None
        with self.autocast():
            out = (self.fwd if grad else self.model)(
                batch.aux,
                batch.input_ids,
                batch.position_ids,
                batch.doc_ids,
                cfg.ttt_steps,
                attention=self.attention,
                return_normed=cfg.fused_loss,
                block_masks=masks,
            )
        if cfg.fused_loss:
            loss, stats = fused_ttt_loss(
                out,
                self.model.lm_head.weight,
                self.head,
                batch.final,
                batch.loss_mask,
                batch.doc_ids,
                cfg.step_decay,
                chunk=cfg.loss_chunk,
                dtype=self.matmul_dtype,
                compiled=cfg.compile,
                scored=scored,
            )
        else:
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                tgt = self.head(batch.final)
            loss, stats = ttt_loss(out, tgt, batch.loss_mask, batch.doc_ids, cfg.step_decay, self.ce)
        return loss, stats, batch.num_tokens

    def train_step(self, step: int) -> dict[str, Any]:
        """Optimizer step ``step`` (0-based), queued on the device; returns its numbers, still there."""
        cfg, device = self.cfg, self.device
        step_stats, loss_acc, step_tokens, step_packs = [], torch.zeros((), device=device), 0, []
        for a, epoch, packs in self.micro_batches(step):
            with parallel.grad_sync(self.net, a == cfg.grad_accum - 1):
                loss, stats, ntok = self.forward_loss(packs, grad=True)
                (loss / cfg.grad_accum).backward()
            step_stats.extend(stats)
            loss_acc += loss.detach()
            step_tokens += ntok
            step_packs.extend(packs)
        # clip 0: the norm is still needed by the guard (an infinite max_norm scales by 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.clip if cfg.clip > 0 else float("inf"))
        per_step = _reduce_stats(step_stats, self.dist, device).view(3, -1, cfg.ttt_steps).sum(1)  # [3, K]
        # torch.full, not torch.tensor: a fill kernel, where a copy of a host scalar would wait
        totals = self.dist.all_sum(torch.stack([loss_acc, torch.full((), float(step_tokens), device=device)]))
        lr = self.optim.param_groups[0]["lr"]  # the rate this step applies
        finite = self.guard.step(totals[0], parallel.local_norm(grad_norm))  # optim.step() unless non-finite
        self.sched.step()
        self.optim.zero_grad(set_to_none=True)
        return {
            "step": step + 1,
            "epoch": epoch,
            "per_step": per_step,
            "totals": totals,
            "finite": finite,
            "grad_norm": grad_norm,
            "lr": lr,
            "packs": step_packs,
            "end": self.log.clock.mark(),
        }

    # ------------------------------------------------------------------ the loop

    def train(self) -> Path:
        """Run (or resume) to the planned step or the time budget; returns RUN_DIR/draft. A feature
        source with engines of its own (--features vllm) is closed however the run ends."""
        ok = False
        tf32 = torch.backends.cuda.matmul.allow_tf32
        if self.device.type == "cuda":
            # TF32 for this run's fp32 matmuls only: what the process does next (the pipeline's
            # evaluation, a caller's extraction in fp32) keeps the setting it had
            torch.backends.cuda.matmul.allow_tf32 = True
        try:
            out = self._train()
            ok = True
            return out
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            close = getattr(self.source, "close", None)
            if close is not None:
                close(ok)

    def _train(self) -> Path:
        cfg = self.cfg
        self.model.train()
        last_eval, step = None, self.start
        # torchrun's ranks would each see the signal at another step: there it stops them at once
        # a rank on another node may have no run folder: its stacks go to its stderr
        stalls = self.run_dir / (f"stalls-rank{self.dist.rank}.txt" if self.dist.on else "stalls.txt")
        stalls = stalls if self.run_dir.is_dir() else None
        with StopRequest(enabled=not self.dist.on) as stop, StallWatch(stalls) as watch:
            while step < self.total:  # a --budget plan may set the end on the way
                done = step + 1
                watch.arm(compiling=not self.clock.started)
                self.log.push(self.train_step(step))  # writes the previous step's record
                tau_due = self._decide(done)
                watch.disarm()
                if cfg.eval_every and done % cfg.eval_every == 0 and done < self.total:
                    self.log.flush()
                    with self.clock.pause():
                        last_eval = self.evaluate(done)
                saving = (cfg.save_every and done % cfg.save_every == 0) or done == self.total
                if saving or stop.requested:
                    self.log.flush()  # tokens_seen goes into the checkpoint
                    with self.clock.pause():
                        self.save(done)  # the last one makes a finished run's --resume a no-op
                if stop.requested and done < self.total:
                    self.log.close()
                    of = "" if self.total == UNPLANNED else f" of {self.total}"  # a budget not yet planned
                    print(
                        f"stopped at step {done}{of}, checkpoint saved in {self.run_dir}: "
                        "run the same command with --resume to go on",
                        file=sys.stderr,
                        flush=True,
                    )
                    raise KeyboardInterrupt
                if tau_due and done < self.total:
                    self.log.flush()
                    self.measure_tau(done)
                step = done
        self.log.close()  # waits for the last step
        self.clock.stop()
        last_eval = self.evaluate(self.total) or last_eval
        return self.finish(self.total, last_eval, self.measure_tau(self.total))

    def _decide(self, done: int) -> bool:
        """After step ``done``: start the training clock (once the compiled first step is behind),
        plan a --budget run's end, and say whether a --tau-every measurement is due. Decided on rank
        0's clock; under torchrun every DECIDE_EVERY steps, shared by all ranks."""
        if not self.clock.started and done - self.start >= 2:  # step 1 compiles; step 2 may still recompile
            self.clock.start(done)
        if self.dist.on and done % DECIDE_EVERY:
            return False
        what = self.planner.due(self.clock, self.lr_schedule) if self.planner is not None else None
        plan = self.planner.total(done, self.clock) if what else None
        kind = {"plan": 1, "replan": 2}.get(what, 0) if plan else 0
        tau_due = self.next_tau_s is not None and self.clock.started and self.clock.steps_s() >= self.next_tau_s
        if self.dist.on:  # rank 0's decision for everyone
            mine = [float(plan or 0), float(kind), float(tau_due)] if self.is_main else [0.0, 0.0, 0.0]
            plan, kind, tau_due = self.dist.all_sum(
                torch.tensor(mine, device=self.device, dtype=torch.float64)
            ).tolist()
            plan, kind, tau_due = int(plan), int(kind), bool(tau_due)
        if kind:
            (self.lr_schedule.plan if kind == 1 else self.lr_schedule.replan)(plan, done)
            self.total = plan
            self.log.set_total(plan)
            passes = self.plan.epochs_at(plan)
            self.plan_info["plan" if kind == 1 else "replan"] = {
                "at_step": done,
                "at_s": round(self.clock.steps_s(), 2),
                "steps": plan,
                "step_s": self.planner.step_s if self.is_main else None,
                "epochs": round(passes, 3),
            }
            # once a run: the replan's pace rarely changes the verdict
            if (
                self.is_main
                and not self._warned_passes
                and (msg := many_passes(passes, self.cfg.budget, self._masked_loops, self._skipped_leading))
            ):
                self._warned_passes = True
                warnings.warn(msg, category=EyasWarning, stacklevel=2)
        if tau_due:
            self.next_tau_s += self.cfg.tau_every
        return tau_due

    def measure_tau(self, step: int) -> dict[str, Any] | None:
        """Tau of the draft as it is now (--tau), on rank 0 while the others wait; logged and printed."""
        rec = None
        if self.tau_probe is not None:
            with self.clock.pause():
                got = self.tau_probe.measure(self.model)
            rec = {
                "split": "tau",
                "step": step,
                "train_s": round(self.clock.steps_s(), 2),
                **{f"tau_k{k}": t for k, t in got["tau"].items()},
                **got,
            }
            self.logger.log(rec)
            if self.cfg.progress:
                from tqdm import tqdm

                tqdm.write(
                    f"step {step}: tau "
                    + ", ".join(f"k={k} {t:.3f}" for k, t in got["tau"].items() if t)
                    + f" ({got['turns']} turns, {got['seconds']:.1f} s)"
                )
        self.dist.barrier()
        return rec

    def evaluate(self, step: int) -> dict[str, Any] | None:
        """Held-out loss and top-1 agreement per TTT step, logged."""
        cfg, dist = self.cfg, self.dist
        n_chunks = len(range(0, len(self.held_packs), cfg.batch_size)[: cfg.eval_batches])
        if not n_chunks:
            return None
        self.model.eval()
        acc = torch.zeros(3, cfg.ttt_steps, device=self.device)
        with torch.no_grad():
            for idx, packs in self.heldout_calls():
                _, stats, _ = self.forward_loss(packs, grad=False)
                if idx < n_chunks:
                    acc += torch.stack([torch.stack([x.loss_sum, x.correct, x.count]) for x in stats], 1).to(
                        self.device
                    )
        acc = dist.all_sum(acc).cpu()
        self.model.train()
        cnt = acc[2].clamp_min(1)
        rec = {
            "split": "heldout",
            "step": step,
            "acc": (acc[1] / cnt).tolist(),
            "loss": (acc[0] / cnt).tolist(),
            "positions": acc[2].tolist(),
        }
        self.logger.log(rec)
        return rec

    def save(self, step: int) -> None:
        """A checkpoint of step ``step`` (collective under FSDP2; written atomically by rank 0)."""
        dist, run_dir = self.dist, self.run_dir
        tmp = ckpt.begin(run_dir, step) if self.is_main else ckpt.tmp_dir_for(run_dir, step)
        dist.barrier()
        ckpt.write_rank_rng(tmp, dist.rank)
        model_state = parallel.full_model_state(self.model)
        optim_state = parallel.full_optim_state(self.model, self.optim)
        dist.barrier()
        if self.is_main:
            check_finite_state(model_state, f"checkpoint of step {step}")
            epoch = self.plan.locate(step)[0] if step < self.total else None
            ckpt.finish(
                run_dir,
                tmp,
                step,
                model_state,
                optim_state,
                self.sched.state_dict(),
                {
                    "step": step,
                    "tokens_seen": self.log.tokens_seen,
                    "epoch": epoch,
                    "world_size": dist.world,
                    "devices": self.devices,
                    "run": self.run_info,
                    "steps_s": self.clock.steps_s(),
                    "budget_plan": self.plan_info,
                },
                self.draft_cfg.to_dict(),
                self.cfg.keep_checkpoints,
            )
        dist.barrier()

    def finish(self, finished: int, last_eval: dict[str, Any] | None, tau: dict[str, Any] | None) -> Path:
        """The draft (never with a non-finite weight) with its measured tau (tau.json), loss.png,
        tau.png and summary.json."""
        out = self.run_dir / "draft"
        final_state = parallel.full_model_state(self.model)  # collective under FSDP2
        if self.is_main:
            check_finite_state(final_state, f"the draft of {self.run_dir}")
            self.model.save_pretrained(out, state=final_state)
            if tau is not None:
                atomic_write_text(out / TAU_FILE, json.dumps({k: tau[k] for k in TAU_KEYS}, indent=2))
            plot_losses(self.run_dir)
            plot_tau(self.run_dir)
            mode = ("fsdp2" if self.sharded else "ddp") if self.dist.on else "single"
            summary = {
                "steps": finished,
                "skipped_nonfinite_steps": self.guard.skipped,
                "first_step_s": self.log.first_step_s,
                "tokens_seen": self.log.tokens_seen,
                "epochs": round(self.plan.epochs_at(finished), 3),
                "heldout": last_eval,
                "tau": tau and {k: tau[k] for k in TAU_KEYS},
                "draft": str(out),
                "world_size": self.dist.world,
                "parallel": mode,
                "attention": self.attention,
                # the time budget's account: steps timed from the end of the first compiled step(s)
                "budget_s": self.cfg.budget,
                "plan": self.plan_info or None,
                "steps_s": round(self.clock.steps_s(), 2),
                "paused_s": round(self.clock.paused, 2),
                "timed_from_step": self.clock.start_step,
            }
            report = getattr(self.source, "report", None)
            if report is not None:  # --features vllm: the engine, the buffer, later epochs, the waits
                from eyas.train.stream import REPORT_FILE

                summary["features"] = report()
                atomic_write_text(self.run_dir / REPORT_FILE, json.dumps(summary["features"], indent=2))
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.logger.close()
        self.dist.barrier()
        return out


def run(cfg: TrainConfig) -> Path:
    """The train stage's entry point (`eyas train`, the pipeline, each torchrun process): train (or
    resume), say where the draft is and the tau measured while training; returns RUN_DIR/draft. The
    run directory is checked, and held by one writer (rank 0 holds it for every rank of a torchrun run)."""
    from eyas.outdir import check_out, writer_lock

    if int(os.environ.get("RANK", "0")) != 0:
        draft = Trainer(cfg).train()
        parallel.teardown_dist()
        return draft
    check_out(
        cfg.out, inputs={"the prepared dataset --data": cfg.data, "the --store": cfg.store, "the --target": cfg.target}
    )
    if cfg.resume and not ckpt.checkpoint_dirs(Path(cfg.out)):  # said before the target loads
        print(ckpt.no_checkpoint_note(Path(cfg.out)), file=sys.stderr, flush=True)
    with writer_lock(cfg.out, command="eyas train"):
        draft = Trainer(cfg).train()
    print(f"draft -> {draft}", file=sys.stderr, flush=True)
    measured = Path(draft) / TAU_FILE
    if measured.is_file():
        m = json.loads(measured.read_text())
        print(
            f"tau by replay on {m['turns']} turns of {m['prompts']} ({m['max_new_tokens']} tokens, step "
            f"{m['step']}): " + ", ".join(f"k={k} {t:.3f}" for k, t in m["tau"].items() if t),
            file=sys.stderr,
            flush=True,
        )
    parallel.teardown_dist()  # last: a gloo rank's process ends in it
    return draft
