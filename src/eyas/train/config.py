"""The settings of `eyas train`: every flag of the command and every key of the pipeline's ``train``
section is one field here (:mod:`eyas.settings`), with its one default, help and range."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eyas.checks import Range, at_least, fraction, int_list, key_values, positive, seconds
from eyas.draft import AttentionKind
from eyas.errors import EyasError
from eyas.evaluate.prompts import DEFAULT_PROMPTS
from eyas.settings import setting

# The settings with a fixed set of values: the annotation is the one list of them (the CLI, the
# pipeline's YAML and the constructor all check against it, eyas.checks).
FeatureSource = Literal["offline", "online", "vllm"]
ScheduleKind = Literal["cosine", "linear", "wsd"]
Precision = Literal["auto", "bf16", "fp32"]
CompileScope = Literal["model", "regions"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
OptimizerKind = Literal["muon", "adamw"]
ParallelMode = Literal["ddp", "fsdp2"]

# Settings that measured no gain (benchmarks/): usable only with --experimental, so that the
# default path is the one that is measured and tested. value -> where it was measured.
EXPERIMENTAL = {
    ("compile_scope", "regions"): "slower steps than --compile-scope model: benchmarks/train_bench.md",
    ("compile_mode", "reduce-overhead"): "benchmarks/train_bench.md",
    ("compile_mode", "max-autotune-no-cudagraphs"): "never measured faster",
}
EXPERIMENTAL_HEAD = {"fc_norm", "norm_before_fc", "norm_output"}  # --draft-config keys (same measurement)


# --draft-config 'intermediate_size=2048,fc_norm=true' -> dict of ints/floats/bools
parse_draft_config = key_values("--draft-config", "intermediate_size=2048,rope_theta=1e6")


def _layers(text: str | None) -> list[int] | None:
    from eyas.features.layers import parse_layers

    return parse_layers(text)


@dataclass(kw_only=True)
class TrainConfig:
    target: str = setting("smollm2-135m-instruct", "HF dir, .gguf file or built-in name.")
    data: str = setting(help="Prepared dataset directory (from `eyas prepare`).")
    out: str = setting(help="Run directory: checkpoints/, draft/, metrics.jsonl, loss.png.")
    features: FeatureSource | None = setting(
        None,
        "Where the target's features come from: offline (the store at --store, from `eyas extract`), "
        "online (the target runs in this job; no store), or vllm (a vLLM engine makes them while the "
        "draft trains, through a bounded buffer, --feature-buffer-gb; no store on disk).",
        aliases={"--online": "online"},
    )
    store: str | None = setting(None, "With --features offline: the extraction store (from `eyas extract`).")
    feature_buffer_gb: float = setting(
        2.0,
        "With --features vllm: the most features (decimal GB) waiting in the buffer directory; the engine "
        "is held back while it is full.",
        check=positive("feature buffer size in GB", "e.g. 2"),
    )
    feature_buffer_dir: str | None = setting(
        None,
        "With --features vllm: the buffer directory (default: under /dev/shm when it has room, else "
        "OUT/feature-buffer).",
    )
    feature_cache_gb: float = setting(
        0.0,
        "With --features vllm: keep up to this many GB of samples' features in OUT/feature-cache for later "
        "epochs (hybrid); 0 extracts every epoch again.",
        check=at_least(0, "feature cache size in GB", "0 extracts again every epoch"),
    )
    feature_timeout: float = setting(
        1800.0,
        "With --features vllm: stop with the engine's log when it makes nothing for this many seconds "
        "(its start-up included).",
        check=positive("seconds without features from the engine"),
    )
    vllm_python: str | None = setting(
        None,
        "With --features vllm: Python of the environment that runs vLLM "
        "(default: this one, $EYAS_VLLM_PYTHON, or .venvs/vllm-*).",
        "--vllm-python",
    )
    tensor_parallel_size: int = setting(
        1, "With --features vllm: the engine's tensor parallelism.", "--tensor-parallel-size", check=at_least(1)
    )
    data_parallel_size: int = setting(
        1, "With --features vllm: engines per training process, fed in turn.", "--data-parallel-size", check=at_least(1)
    )
    gpu_memory_utilization: float = setting(
        0.3,
        "With --features vllm: the fraction of a GPU's memory the engine may take (it shares the GPU "
        "with the trainer when it has one engine of one GPU); passed to vLLM.",
        "--gpu-memory-utilization",
        check=Range(lo=0, hi=1, lo_open=True, what="fraction of GPU memory for the engine", hint="e.g. 0.3"),
    )
    layers: list[int] | None = setting(
        None,
        "Aux layer ids (default 2,N/2,N-3 online; offline: the store's, checked if given).",
        parse=_layers,
        cli_type=str,
    )
    ttt_steps: int = setting(
        3,
        "Training-time-test steps unrolled per position.",
        check=at_least(1, "training-time-test steps unrolled", "use 1 for plain next-token training"),
    )
    step_decay: float = setting(
        0.8,
        "Loss weight of TTT step j is step_decay**j.",
        check=positive("loss weight ratio between TTT steps", "e.g. 0.8"),
    )
    lr: float = setting(
        1e-3,
        "Peak learning rate (Muon's is RMS-matched to AdamW's).",
        check=positive("peak learning rate", "e.g. 1e-3"),
    )
    min_lr_ratio: float = setting(
        0.1,
        "Learning rate at the last step, as a fraction of the peak.",
        check=fraction("final LR as a fraction of the peak"),
    )
    weight_decay: float = setting(0.0, "Weight decay (AdamW, and Muon with --optimizer muon).", check=at_least(0))
    betas: tuple[float, float] = setting(
        (0.9, 0.95), "AdamW betas.", check=Range(lo=0, hi=1, hi_open=True, what="AdamW beta", hint="e.g. 0.9 0.95")
    )
    epochs: int | None = setting(
        None,
        "Passes over the training split (default 1; with --budget, as many as the budget takes, at "
        "most this many if given). --max-steps overrides it.",
        check=at_least(1),
    )
    max_steps: int | None = setting(
        None,
        "Optimizer steps to run (overrides --epochs; with --budget, at most this many).",
        check=at_least(1, "optimizer steps", "leave it out to run --epochs"),
    )
    budget: float | str | None = setting(
        None,
        "Train for this long, e.g. 10m, 90s, 1h30m or seconds: after the compiled first step the steps "
        "are timed and the step count set so that the LR schedule (warmup, decay to its floor) ends "
        "when the budget does. Counts the optimizer steps' time (not set-up, the first step's "
        "compilation, evaluations, checkpoints or tau measurements; summary.json has them all).",
        check=positive("training time budget"),
        parse=seconds,
        cli_type=str,
    )
    schedule: ScheduleKind = setting(
        "wsd",
        "LR decay after warmup: wsd (held at the peak, then linear over the last --decay-fraction of "
        "the steps), cosine or linear; each ends at --min-lr-ratio on the last step.",
    )
    decay_fraction: float = setting(
        0.2,
        "With --schedule wsd: the fraction of the steps spent decaying.",
        check=Range(lo=0, hi=1, lo_open=True, what="fraction of steps decaying"),
    )
    # a pack of fewer than 3 tokens has no position with both an input and a next-token target
    # left after the shift, and the first backward fails
    tokens_per_batch: int = setting(
        2048,
        "Tokens per pack (documents packed, no cross-attention).",
        check=at_least(3, "tokens per pack", "use at least the dataset's max_length, e.g. 2048"),
    )
    batch_size: int | None = setting(
        None, "Packs per micro-batch (default 8 on CUDA, 1 on the CPU).", check=at_least(1, "packs per micro-batch")
    )
    grad_accum: int = setting(
        1, "Micro-batches per optimizer step (per process).", check=at_least(1, "micro-batches per optimizer step")
    )
    warmup: int = setting(50, "Linear warmup steps, then --schedule's decay.", check=at_least(0, "warmup steps"))
    clip: float = setting(
        0.5, "Gradient-norm clip (0 = off).", check=at_least(0, "gradient-norm clip", "0 turns clipping off")
    )
    max_nonfinite_steps: int = setting(
        3,
        "A step with a non-finite loss or gradient norm is skipped (not applied); this many in a row "
        "stop the run with an error naming the step and its samples.",
    )
    save_every: int = setting(
        500,
        "Checkpoint every N optimizer steps (atomic).",
        check=at_least(0, "steps between checkpoints", "0 saves only at the end"),
    )
    keep_checkpoints: int = setting(
        2, "Checkpoints kept (the newest; 0 keeps all).", check=at_least(0, "checkpoints kept", "0 keeps all")
    )
    eval_every: int = setting(
        200,
        "Held-out loss and top-1 agreement every N steps (0 = only at the end).",
        check=at_least(0, "steps between held-out evaluations", "0 evaluates only at the end"),
    )
    eval_batches: int = setting(
        8, "Held-out micro-batches per evaluation.", check=at_least(1, "held-out micro-batches per evaluation")
    )
    heldout: float = setting(
        0.02,
        "Fraction of samples held out (by index hash).",
        check=fraction("fraction of samples held out", hi_open=True),
    )
    tau: bool | None = setting(
        None,
        "Measure the draft's tau while it trains: greedy acceptance by replay (`eyas evaluate --engine "
        "replay`, the draft in the target's dtype) on --tau-prompts, at the end and every --tau-every, "
        "the target's answers made once and kept in eyas's cache; logged, plotted (tau.png) and "
        "written beside the draft (tau.json). Default: on where the target runs in this job on a GPU "
        "(--features online on CUDA), off elsewhere.",
        "--tau/--no-tau",
    )
    tau_every: float | str | None = setting(
        None,
        "With --tau: also measure every this much training time, e.g. 2m (default: only at the end).",
        check=positive("training time between tau measurements"),
        parse=seconds,
        cli_type=str,
    )
    tau_prompts: Path = setting(DEFAULT_PROMPTS, "With --tau: MT-bench style question.jsonl.")
    tau_per_category: int = setting(
        0,
        "With --tau: only the first N questions of each category of --tau-prompts; 0: all (the default: "
        "MT-bench's first questions of each category read high, benchmarks/recipe/README.md).",
        check=at_least(0, "questions per category", "0 takes them all"),
    )
    tau_max_new_tokens: int = setting(
        256,
        "With --tau: tokens per answer, as `eyas evaluate --max-new-tokens`.",
        check=at_least(1, "tokens per answer"),
    )
    tau_k: list[int] = setting(
        [3, 5, 7],
        "With --tau: the numbers of draft tokens per step to report, e.g. 3,5,7.",
        parse=int_list("--tau-k", "3,5,7"),
        cli_type=str,
    )
    log_every: int = setting(
        1,
        "Write a training record (metrics.jsonl, TensorBoard) every N steps.",
        check=at_least(1, "steps between training records"),
    )
    resume: bool = setting(False, "Continue from the latest checkpoint in --out.", "--resume")
    device: str = setting("auto", "cuda, cpu or auto (torchrun: one GPU per process).")
    precision: Precision = setting("auto", "bf16 (autocast), fp32, or auto (bf16 on GPU).")
    seed: int = setting(0, "Seed for init and data order.", check=at_least(0))
    draft_config: dict[str, Any] = setting(
        {},
        "Draft overrides, e.g. 'intermediate_size=2048,rope_theta=1e6'.",
        "--draft-config",
        parse=parse_draft_config,
        cli_type=str,
    )
    # None: on where it is measured fast and correct (CUDA, benchmarks/numerics/README.md), off on
    # the CPU, where inductor's compile costs more than it saves on a short job
    compile: bool | None = setting(
        None,
        "torch.compile the draft's TTT forward and the loss (default: on CUDA, off on the CPU).",
        "--compile/--no-compile",
    )
    compile_scope: CompileScope = setting(
        "model",
        "With --compile: model (the whole TTT forward in one graph) or, with --experimental, "
        "regions (each TTT step's two dense regions; its start-up and step times are in "
        "benchmarks/compile_time.md and train_bench.md).",
    )
    compile_mode: CompileMode = setting(
        "default",
        "With --compile: torch.compile's mode: default or, with --experimental, "
        "reduce-overhead (CUDA graphs) or max-autotune-no-cudagraphs.",
    )
    fused_loss: bool | None = setting(
        None,
        "lm_head, the target distribution and the cross entropy chunked over the positions the "
        "loss counts: no [tokens, vocab] tensors kept, same loss and gradients (default: on CUDA, "
        "off on the CPU).",
        "--fused-loss/--no-fused-loss",
    )
    loss_chunk: int = setting(
        4096,
        "With --fused-loss: rows per chunk (each chunk's fp32 temporaries are [rows, draft vocab]).",
        check=at_least(1, "rows per chunk of the fused loss"),
    )
    optimizer: OptimizerKind | None = setting(
        None,
        "muon: Muon (torch.optim.Muon, RMS-matched to AdamW's lr) for the layer's and fc's matrices, "
        "AdamW for lm_head and norms; or adamw. Default muon (adamw under --parallel fsdp2).",
    )
    parallel: ParallelMode = setting(
        "ddp",
        "ddp or fsdp2 (sharded params, grads and optimizer state); only "
        "used when torchrun starts more than one process.",
    )
    attention: AttentionKind = setting(
        "auto",
        "TTT attention kernel: dense, flex (block-sparse flex_attention, compiled; CUDA only for "
        "training) or auto (flex on CUDA, dense elsewhere).",
    )
    experimental: bool = setting(
        False,
        "Allow the settings that measured no gain: --compile-scope regions, --compile-mode "
        "reduce-overhead / max-autotune-no-cudagraphs, --draft-config "
        "fc_norm / norm_before_fc / norm_output.",
        "--experimental",
    )
    progress: bool = setting(True, "Show the progress bar.", "--progress/--quiet")

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass

        # durations may come as text (YAML `budget: 10m`); the field then holds seconds
        self.budget, self.tau_every = seconds(self.budget), seconds(self.tau_every)
        check_dataclass(self, "train")  # types, ranges and choices, before anything loads
        if any(k < 1 for k in self.tau_k) or not self.tau_k:
            raise EyasError(f"--tau-k {self.tau_k}: give one or more numbers of draft tokens per step, each >= 1")
        if self.budget is not None and self.features == "vllm":
            raise EyasError(
                "--budget with --features vllm: the engine is fed the run's planned batches ahead "
                "of training, so the step count must be known up front; use --max-steps or --epochs"
            )
        if self.store and self.features is None:
            raise EyasError(f"--store {self.store}: the store is read with --features offline; pass that too")
        if self.store and self.features != "offline":
            raise EyasError(
                f"--features {self.features} does not go with --store (the offline store); pass "
                "--features offline to train from the store, or leave --store out"
            )
        if self.features == "offline" and not self.store:
            raise EyasError("--features offline needs --store STORE (from `eyas extract`)")
        _check_draft_config(self.draft_config)
        if not self.experimental:
            for (key, value), why in EXPERIMENTAL.items():
                if getattr(self, key) == value:
                    raise EyasError(
                        f"--{key.replace('_', '-')} {value}: measured no gain ({why}); pass "
                        "--experimental (train.experimental: true) to use it anyway"
                    )
            heads = sorted(k for k in EXPERIMENTAL_HEAD if self.draft_config.get(k))
            if heads:
                raise EyasError(
                    f"--draft-config {', '.join(f'{k}=true' for k in heads)}: measured no gain on "
                    "the CPU proxy (benchmarks/draft_options_cpu.md); pass --experimental "
                    "(train.experimental: true) to use it anyway"
                )


def _check_draft_config(overrides: dict[str, Any]) -> None:
    from dataclasses import fields

    from eyas.draft.model import DraftConfig

    allowed = {f.name for f in fields(DraftConfig)} - {
        "kind",
        "target",
        "vocab_size",
        "draft_vocab_size",
        "aux_layer_ids",
        "target_hidden_size",
    }
    bad = sorted(set(overrides) - allowed)
    if bad:
        raise EyasError(f"--draft-config: unknown or fixed fields {bad}; settable: {sorted(allowed)}")
    from eyas.draft.model import check_override_values

    check_override_values(overrides)
