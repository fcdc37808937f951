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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.draft import flex
from eyas.draft.fused_loss import fused_ttt_loss
from eyas.draft.fused_loss import positions as fused_positions
from eyas.draft.loss import TargetHead, soft_cross_entropy, ttt_loss
from eyas.draft.model import DraftConfig, Eagle3Draft, check_finite_state
from eyas.errors import EyasError
from eyas.train import checkpoint as ckpt
from eyas.train.guard import NonFiniteGuard
from eyas.train.metrics import Logger, StepClock, plot_losses
from eyas.train import optim as optim_mod
from eyas.train import parallel
from eyas.train.packing import pack_indices, split_indices

# Fields that must match between a run and its resume (they fix the data order and the objective).
RESUME_KEYS = ("target_id", "dataset_id", "tokens_per_batch", "batch_size", "global_micro", "seed",
               "ttt_steps", "heldout_fraction", "aux_layers", "optimizer")
RESUME_DEFAULTS = {"optimizer": "adamw"}  # what checkpoints written before the key existed used
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class TrainConfig:
    target: str
    data: str
    out: str
    store: str | None = None
    online: bool = False
    ttt_steps: int = 7
    step_decay: float = 0.8
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    epochs: int = 1
    max_steps: int | None = None
    # Stop (and write the draft) once this much training time has passed after the first optimizer
    # step, so set-up and compilation are not counted; the LR schedule stays the one planned for
    # max_steps. For equal wall-clock budgets. A resumed run counts afresh.
    max_train_seconds: float | None = None
    tokens_per_batch: int = 2048
    batch_size: int = 1  # packs per micro-batch
    grad_accum: int = 1
    warmup: int = 50
    clip: float = 0.5
    # optimizer steps skipped in a row for a non-finite loss or gradient norm before the run stops
    # with an error (eyas.train.guard)
    max_nonfinite_steps: int = 3
    save_every: int = 500
    keep_checkpoints: int = 2
    eval_every: int = 200
    eval_batches: int = 8
    heldout_fraction: float = 0.02
    log_every: int = 1
    resume: bool = False
    device: str = "auto"
    precision: str = "auto"  # bf16 autocast on GPU, fp32 on CPU
    seed: int = 0
    layers: list[int] | None = None
    draft_overrides: dict[str, Any] = field(default_factory=dict)
    compile: bool = False
    # what --compile compiles: "model" (the whole TTT forward in one graph: the fastest steps measured)
    # or "regions" (the TTT step's two dense regions, one graph each for every step: a much shorter
    # cold compile, slower steps; benchmarks/train_bench.md)
    compile_scope: str = "model"
    # torch.compile's mode for --compile-scope model: "default", "reduce-overhead" (CUDA graphs: the
    # host launches a step's kernels as one graph) or "max-autotune-no-cudagraphs"
    compile_mode: str = "default"
    # lm_head + target distribution + CE chunked over the counted positions (eyas.draft.fused_loss):
    # no [tokens, draft_vocab] tensors kept; the same loss and gradients
    fused_loss: bool = False
    loss_chunk: int = 4096  # rows per chunk of the fused loss: fp32 [chunk, draft_vocab] temporaries
    optimizer: str = "adamw"  # adamw | muon (Muon for the hidden matrices, AdamW for lm_head and norms)
    parallel: str = "ddp"  # ddp | fsdp2; used only when torchrun starts more than one process
    attention: str = "auto"  # dense | flex | auto (flex on CUDA): the TTT unroll's attention kernel
    progress: bool = True

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass

        check_dataclass(self, "train")  # types and ranges, before anything loads (eyas.checks.RANGES)


# ------------------------------------------------------------------------------ distributed


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def on(self) -> bool:
        return self.world > 1

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.on:
            torch.distributed.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.on:
            torch.distributed.barrier()


def setup_dist(device_arg: str) -> tuple[Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    if device_arg.startswith("cuda") and not torch.cuda.is_available():
        raise EyasError(f"--device {device_arg}: CUDA is not available here; use --device cpu")
    device = torch.device(f"cuda:{local}" if device_arg == "cuda" else device_arg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local), device


# ------------------------------------------------------------------------------ schedule


class EpochPlan:
    """Packs per epoch, and the mapping optimizer step -> (epoch, step within epoch)."""

    def __init__(self, train_idx: np.ndarray, lengths: np.ndarray, budget: int, batch: int,
                 global_micro: int, seed: int):
        self.train_idx, self.lengths, self.budget = train_idx, lengths, budget
        self.batch, self.global_micro, self.seed = batch, global_micro, seed
        self._packs: dict[int, list[list[int]]] = {}  # at most two epochs' packs
        self._counts: dict[int, int] = {}

    def packs(self, epoch: int) -> list[list[int]]:
        if epoch not in self._packs:
            if len(self._packs) >= 2:  # keep this and the neighbouring epoch (read-ahead crosses it)
                self._packs.pop(max(self._packs, key=lambda e: abs(e - epoch)))
            self._packs[epoch] = pack_indices(self.train_idx, self.lengths, self.budget,
                                              seed=self.seed * 100003 + epoch)
            self._counts[epoch] = len(self._packs[epoch])
        return self._packs[epoch]

    def steps_in(self, epoch: int) -> int:
        if epoch not in self._counts:
            self._counts[epoch] = len(pack_indices(self.train_idx, self.lengths, self.budget,
                                                   seed=self.seed * 100003 + epoch))
        return self._counts[epoch] // (self.batch * self.global_micro)

    def locate(self, step: int) -> tuple[int, int]:
        epoch = 0
        while step >= self.steps_in(epoch):
            if self.steps_in(epoch) == 0:
                raise EyasError("the training split is smaller than one global batch "
                                f"({self.batch * self.global_micro} packs of {self.budget} tokens); "
                                "lower --tokens-per-batch/--grad-accum or add data")
            step -= self.steps_in(epoch)
            epoch += 1
        return epoch, step


# ------------------------------------------------------------------------------ training


def _autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """bf16 for bf16 autocast, None for plain fp32."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32":
        return None
    raise EyasError(f"--precision {precision!r}: use auto, bf16 or fp32")


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext


def build_source(cfg: TrainConfig, target, dataset, device: torch.device):
    from eyas.train.features import OfflineFeatures, OnlineFeatures

    # bf16 features on GPU, except for --precision fp32 (the draft's fp32 fc would meet bf16 input)
    feat_dtype = torch.bfloat16 if device.type == "cuda" and cfg.precision != "fp32" else torch.float32
    if cfg.online == bool(cfg.store):
        raise EyasError("pass exactly one feature source: --store STORE (offline, from `eyas extract`) "
                        "or --online (the target runs in the training job)")
    if cfg.online:
        return OnlineFeatures(target, dataset, cfg.layers, device, feat_dtype, cfg.tokens_per_batch)
    return OfflineFeatures(cfg.store, target, dataset, cfg.layers, device, feat_dtype, cfg.tokens_per_batch)


def _reduce_stats(stats_list, dist: Dist, device) -> torch.Tensor:
    """[3, K] (loss_sum, correct, count) summed over micro-batches and ranks."""
    t = torch.stack([torch.stack([s.loss_sum, s.correct, s.count]) for s in stats_list], dim=1).to(device)
    return dist.all_sum(t)


def train(cfg: TrainConfig) -> Path:
    """Run (or resume) training; returns RUN_DIR/draft."""
    t_start = time.perf_counter()
    from eyas.data.dataset import open_prepared
    from eyas.target import resolve_target

    parallel.check_mode(cfg.parallel)
    if cfg.compile_scope not in ("regions", "model"):
        raise EyasError(f"--compile-scope {cfg.compile_scope!r}: use 'model' or 'regions'")
    if cfg.compile_mode not in COMPILE_MODES:
        raise EyasError(f"--compile-mode {cfg.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}")
    if cfg.log_every < 1:
        raise EyasError(f"--log-every {cfg.log_every}: must be at least 1")
    if cfg.loss_chunk < 1:
        raise EyasError(f"--loss-chunk {cfg.loss_chunk}: must be at least 1 (rows per chunk of the fused loss)")
    dist, device = setup_dist(cfg.device)
    if device.type == "cuda" or cfg.compile:
        # inductor's and Triton's caches (flex attention is compiled on every CUDA run) under eyas's
        # cache: a second run of the same shapes reuses the first one's kernels and graphs
        from eyas.target import cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "compile" / f"torch-{torch.__version__}"))
    attention = flex.resolve(cfg.attention, device, backward=True)
    run_dir = Path(cfg.out)
    is_main = dist.rank == 0
    if attention == "flex" and cfg.tokens_per_batch % flex.TILE and is_main:
        import warnings

        warnings.warn(f"--tokens-per-batch {cfg.tokens_per_batch} is not a multiple of {flex.TILE}: flex's "
                      "block masks are then built by a compiled create_block_mask, which took 4 minutes on a "
                      f"cold cache (benchmarks/compile_time.md); use a multiple of {flex.TILE}", stacklevel=1)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    target = resolve_target(cfg.target)
    dataset = open_prepared(cfg.data, target=target)
    d2t, t2d = dataset.draft_vocab()
    source = build_source(cfg, target, dataset, device)
    tcfg = target.config()
    text_cfg = tcfg.get("text_config", tcfg)

    global_micro = dist.world * cfg.grad_accum
    train_idx, held_idx = split_indices(len(dataset), cfg.heldout_fraction)
    plan = EpochPlan(train_idx, dataset.lengths, cfg.tokens_per_batch, cfg.batch_size, global_micro, cfg.seed)
    epoch_steps = [plan.steps_in(e) for e in range(cfg.epochs)]
    total = cfg.max_steps if cfg.max_steps is not None else sum(epoch_steps)
    if total <= 0 or epoch_steps[0] == 0:
        raise EyasError(f"dataset {cfg.data}: {len(train_idx)} training samples make "
                        f"{len(plan.packs(0))} packs of {cfg.tokens_per_batch} tokens, fewer than one "
                        f"global batch of {cfg.batch_size * global_micro}; lower --tokens-per-batch or "
                        "--grad-accum, or add data")
    run_info = {"target_id": target.id, "dataset_id": dataset.manifest.get("id"),
                "tokens_per_batch": cfg.tokens_per_batch, "batch_size": cfg.batch_size,
                "global_micro": global_micro, "seed": cfg.seed, "ttt_steps": cfg.ttt_steps,
                "heldout_fraction": cfg.heldout_fraction, "aux_layers": list(source.aux_layers),
                "optimizer": cfg.optimizer}

    too_long = int((dataset.lengths > cfg.tokens_per_batch).sum())
    if too_long and is_main:
        import warnings

        warnings.warn(f"{too_long} of {len(dataset)} samples are longer than --tokens-per-batch "
                      f"{cfg.tokens_per_batch} and are cut to it (their tails, often assistant tokens, are "
                      "not trained on); use --tokens-per-batch >= the dataset's max_length "
                      f"({dataset.manifest.get('max_length')}) to keep them whole", stacklevel=1)
    existing = ckpt.checkpoint_dirs(run_dir)
    if existing and not cfg.resume:
        raise EyasError(f"run directory {run_dir} already has checkpoints (latest {existing[-1].name}); "
                        "pass --resume to continue it, or choose a new --out")
    # the newest checkpoint that reads back whole; unreadable newer ones are named and moved aside
    resumed = ckpt.load_latest(run_dir, dist.rank) if (existing and cfg.resume) else None

    draft_cfg = DraftConfig.from_target(tcfg, source.aux_layers, int(d2t.numel()), target.identity,
                                        target_name_or_path=str(target.path), target_spec=target.spec,
                                        **cfg.draft_overrides)
    if resumed:
        old = resumed["trainer"]["run"]
        diffs = [f"{k}: {old.get(k, RESUME_DEFAULTS.get(k))!r} there, {run_info[k]!r} now" for k in RESUME_KEYS
                 if old.get(k, RESUME_DEFAULTS.get(k)) != run_info[k]]
        if diffs:
            raise EyasError(f"cannot resume {resumed['path']}: " + "; ".join(diffs) +
                            ". Resume with the same settings, or start a new --out")
        draft_cfg = DraftConfig.from_dict(resumed["config"])
        model = Eagle3Draft(draft_cfg)
        model.load_state_dict(resumed["model"])
    else:
        model = Eagle3Draft.from_target(draft_cfg, target.path, d2t, t2d, seed=cfg.seed)
    model.to(device)
    head = TargetHead.from_target(target.path, d2t, float(text_cfg.get("rms_norm_eps", 1e-6))).to(device)
    # wrap first: FSDP2 turns the parameters into shards, and the optimizer must hold those
    net = parallel.wrap(model, cfg.parallel, dist.world, device, fused_loss=cfg.fused_loss)
    sharded = parallel.is_fsdp(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = optim_mod.build(model, cfg.optimizer, cfg.lr, cfg.betas, cfg.weight_decay,
                            fused=device.type == "cuda", sharded=sharded)
    sched = optim_mod.schedule(optim, optim_mod.lr_lambda(cfg.warmup, total, cfg.min_lr_ratio))
    guard = NonFiniteGuard(optim, cfg.max_nonfinite_steps)
    start = 0
    if resumed:
        parallel.load_optim_state(model, optim, resumed["optimizer"])
        sched.load_state_dict(resumed["scheduler"])
        start = int(resumed["trainer"]["step"])
        if resumed["rng"] is not None:
            ckpt.set_rng_state(resumed["rng"])
    else:
        torch.manual_seed(cfg.seed + dist.rank)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    if cfg.compile and cfg.compile_scope == "regions":
        model.compile_regions()  # per TTT step, not the whole unroll: compile time independent of the steps
    fwd = net
    if cfg.compile and cfg.compile_scope == "model":
        fwd = torch.compile(net, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    # the loss's [tokens, draft_vocab] fp32 passes are most of a step's memory traffic; compiled, one
    # fused reduction (dynamic: each TTT step scores a different number of positions)
    ce = torch.compile(soft_cross_entropy, dynamic=True) if cfg.compile else soft_cross_entropy
    matmul_dtype = _autocast_dtype(device, cfg.precision)  # also the fused loss's lm_head dtype
    autocast = _autocast(device, matmul_dtype)
    logger = Logger(run_dir, start, is_main)

    def micro_packs(step: int, a: int) -> tuple[int, list[list[int]]]:
        epoch, off = plan.locate(step)
        m = off * global_micro + a * dist.world + dist.rank
        return epoch, plan.packs(epoch)[m * cfg.batch_size:(m + 1) * cfg.batch_size]

    def micro_batches(step: int):
        for a in range(cfg.grad_accum):
            epoch, packs = micro_packs(step, a)
            nxt = (step, a + 1) if a + 1 < cfg.grad_accum else (step + 1, 0)
            if nxt[0] < total:
                source.prefetch(micro_packs(*nxt)[1])  # read ahead while this one trains
            yield a, epoch, packs

    def run_batch(packs, grad: bool):
        batch = source.batch(packs)
        # the fused loss's positions from the host's copy of the layout, before the forward is
        # queued: found on the device, they would wait for it
        scored = (fused_positions(batch.layout.loss_mask, batch.layout.doc_ids, cfg.ttt_steps)
                  if cfg.fused_loss else None)
        # built here, outside the compiled forward: inside its graph they made flex compute wrong
        # attention on CUDA (flex.ttt_block_masks)
        masks = flex.ttt_block_masks(batch.doc_ids, cfg.ttt_steps) if attention == "flex" else None
        with autocast():
            out = (fwd if grad else model)(batch.aux, batch.input_ids, batch.position_ids, batch.doc_ids,
                                           cfg.ttt_steps, attention=attention, return_normed=cfg.fused_loss,
                                           block_masks=masks)
        if cfg.fused_loss:
            loss, stats = fused_ttt_loss(out, model.lm_head.weight, head, batch.final, batch.loss_mask,
                                         batch.doc_ids, cfg.step_decay, chunk=cfg.loss_chunk, dtype=matmul_dtype,
                                         compiled=cfg.compile, scored=scored)
            return loss, stats, batch.num_tokens
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            tgt = head(batch.final)
        loss, stats = ttt_loss(out, tgt, batch.loss_mask, batch.doc_ids, cfg.step_decay, ce)
        return loss, stats, batch.num_tokens

    held_packs = pack_indices(held_idx, dataset.lengths, cfg.tokens_per_batch, seed=None)

    def evaluate(step: int) -> dict[str, Any] | None:
        chunks = [held_packs[i:i + cfg.batch_size] for i in range(0, len(held_packs), cfg.batch_size)]
        chunks = chunks[:cfg.eval_batches]
        if not chunks:
            return None
        model.eval()
        acc = None
        # FSDP2's forward is collective: every rank runs the same number of batches, and a rank
        # past the end reruns chunk 0 with its counts dropped
        rounds = -(-len(chunks) // dist.world) if sharded else None
        mine = list(range(dist.rank, len(chunks), dist.world))
        with torch.no_grad():
            for i in range(rounds) if sharded else mine:
                idx = (i * dist.world + dist.rank) if sharded else i
                _, stats, _ = run_batch(chunks[idx if idx < len(chunks) else 0], grad=False)
                if idx >= len(chunks):
                    continue
                s = torch.stack([torch.stack([x.loss_sum, x.correct, x.count]) for x in stats], 1).to(device)
                acc = s if acc is None else acc + s
        if acc is None:
            acc = torch.zeros(3, cfg.ttt_steps, device=device)
        acc = dist.all_sum(acc).cpu()
        model.train()
        cnt = acc[2].clamp_min(1)
        rec = {"split": "heldout", "step": step, "acc": (acc[1] / cnt).tolist(),
               "loss": (acc[0] / cnt).tolist(), "positions": acc[2].tolist()}
        logger.log(rec)
        return rec

    def save(step: int, tokens_seen: int) -> None:
        tmp = ckpt.begin(run_dir, step) if is_main else ckpt.tmp_dir_for(run_dir, step)
        dist.barrier()
        ckpt.write_rank_rng(tmp, dist.rank)
        model_state = parallel.full_model_state(model)  # collective under FSDP2
        optim_state = parallel.full_optim_state(model, optim)
        dist.barrier()
        if is_main:
            check_finite_state(model_state, f"checkpoint of step {step}")
            ckpt.finish(run_dir, tmp, step, model_state, optim_state, sched.state_dict(),
                        {"step": step, "tokens_seen": tokens_seen, "epoch": plan.locate(step)[0] if step < total else None,
                         "world_size": dist.world, "run": run_info},
                        draft_cfg.to_dict(), cfg.keep_checkpoints)
        dist.barrier()

    tokens_seen = int(resumed["trainer"].get("tokens_seen", 0)) if resumed else 0
    bar = None
    if is_main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
    model.train()
    clock = StepClock(device)
    t_last, tok_last = clock.mark(), 0
    last_eval = None
    t_first: float | None = None  # end of this process's first step (max_train_seconds)
    first_step_s: float | None = None  # from train()'s start to the first step's numbers: set-up + compile
    finished, stopped_by_time = total, False
    # A step's numbers stay on the device until the next step is queued: reading them waits for the
    # device, and reading them at once would leave it idle while the host prepares the next step.
    pending: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal pending, tokens_seen, t_last, tok_last, first_step_s
        if pending is None:
            return
        p, pending = pending, None
        totals, per_step, done = p["totals"].tolist(), p["per_step"].cpu(), p["step"]
        if first_step_s is None:
            first_step_s = time.perf_counter() - t_start
        finite = bool(p["finite"])
        tokens_seen += int(totals[1])
        tok_last += int(totals[1])
        cnt = per_step[2].clamp_min(1)
        step_loss = (per_step[0] / cnt).tolist()
        guard.record(finite, done, {"step_loss": step_loss, "grad_norm": parallel.total_norm(p["grad_norm"]),
                                    "samples": sorted(i for pack in p["packs"] for i in pack)})
        if done % cfg.log_every == 0 or done == total or not finite:
            secs = clock.seconds(t_last, p["end"])  # the device's time between the two steps' ends
            tps = tok_last / max(secs, 1e-9)
            t_last, tok_last = p["end"], 0
            rec = {"split": "train", "step": done, "loss": totals[0] / global_micro,
                   "lr": p["lr"], "grad_norm": parallel.total_norm(p["grad_norm"]), "tokens": tokens_seen,
                   "tokens_per_s": tps, "epoch": p["epoch"], "finite": finite, "skipped_steps": guard.skipped,
                   "acc": (per_step[1] / cnt).tolist(), "step_loss": step_loss}
            logger.log(rec)
            guard.stop_if_repeated()
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.2f}", tok_s=f"{tps:,.0f}")
        if bar is not None:
            bar.update(1)

    for step in range(start, total):
        step_stats, loss_acc, step_tokens, step_packs = [], torch.zeros((), device=device), 0, []
        for a, epoch, packs in micro_batches(step):
            with parallel.grad_sync(net, a == cfg.grad_accum - 1):
                loss, stats, ntok = run_batch(packs, grad=True)
                (loss / cfg.grad_accum).backward()
            step_stats.extend(stats)
            loss_acc += loss.detach()
            step_tokens += ntok
            step_packs.extend(packs)
        # clip 0: the norm is still needed by the guard (an infinite max_norm scales by 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else float("inf"))
        k = cfg.ttt_steps
        per_step = _reduce_stats(step_stats, dist, device).view(3, -1, k).sum(1)  # [3, K]
        # torch.full, not torch.tensor: a fill kernel, where a copy of a host scalar would wait
        totals = dist.all_sum(torch.stack([loss_acc, torch.full((), float(step_tokens), device=device)]))
        finite = guard.step(totals[0], parallel.local_norm(grad_norm))  # optim.step() unless non-finite
        sched.step()
        optim.zero_grad(set_to_none=True)
        done = step + 1
        flush()  # the previous step's, now that this one is queued
        pending = {"step": done, "epoch": epoch, "per_step": per_step, "totals": totals, "finite": finite,
                   "grad_norm": grad_norm, "lr": sched.get_last_lr()[0], "packs": step_packs, "end": clock.mark()}
        if cfg.eval_every and done % cfg.eval_every == 0 and done < total:
            flush()
            last_eval = evaluate(done)
        if (cfg.save_every and done % cfg.save_every == 0) or done == total:
            flush()  # tokens_seen goes into the checkpoint
            save(done, tokens_seen)  # the last one makes a finished run's --resume a no-op
        if cfg.max_train_seconds and done < total:
            now = time.perf_counter()
            t_first = now if t_first is None else t_first
            over = now - t_first >= cfg.max_train_seconds
            if dist.on:  # every rank stops at the same step
                over = dist.all_sum(torch.full((), float(over), device=device)).item() > 0
            if over:
                flush()
                finished, stopped_by_time = done, True
                if not (cfg.save_every and done % cfg.save_every == 0):
                    save(done, tokens_seen)
                break
    flush()
    if bar is not None:
        bar.close()
    last_eval = evaluate(finished) or last_eval
    out = run_dir / "draft"
    final_state = parallel.full_model_state(model)  # collective under FSDP2
    if is_main:
        check_finite_state(final_state, f"the draft of {run_dir}")
        model.save_pretrained(out, state=final_state)
        plot_losses(run_dir)
        mode = ("fsdp2" if sharded else "ddp") if dist.on else "single"
        summary = {"steps": finished, "planned_steps": total, "stopped_by_time": stopped_by_time,
                   "skipped_nonfinite_steps": guard.skipped, "first_step_s": first_step_s,
                   "tokens_seen": tokens_seen, "heldout": last_eval, "draft": str(out),
                   "world_size": dist.world, "parallel": mode, "attention": attention}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    dist.barrier()
    return out
