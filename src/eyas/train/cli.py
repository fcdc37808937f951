"""The `eyas train` command (works the same under `torchrun ... -m eyas.cli train`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from eyas.errors import EyasError
from eyas.train.predict import PREDICTION_FILE


def _overrides(text: str | None) -> dict:
    """--draft-config 'intermediate_size=2048,fc_norm=true' -> dict of ints/floats/bools."""
    out: dict = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise EyasError(f"--draft-config {text!r}: expected key=value pairs separated by commas")
        k, v = (x.strip() for x in part.split("=", 1))
        if v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    from dataclasses import fields

    from eyas.draft.model import DraftConfig

    allowed = {f.name for f in fields(DraftConfig)} - {"kind", "target", "vocab_size", "draft_vocab_size",
                                                       "aux_layer_ids", "target_hidden_size"}
    bad = sorted(set(out) - allowed)
    if bad:
        raise EyasError(f"--draft-config: unknown or fixed fields {bad}; settable: {sorted(allowed)}")
    return out


def register(app: typer.Typer) -> None:
    @app.command()
    def train(
        target: str = typer.Option("smollm2-135m-instruct", help="HF dir, .gguf file or built-in name."),
        data: Path = typer.Option(..., help="Prepared dataset directory (from `eyas prepare`)."),
        out: Path = typer.Option(..., help="Run directory: checkpoints/, draft/, metrics.jsonl, loss.png."),
        store: Path = typer.Option(None, help="Extraction store (offline features, from `eyas extract`)."),
        online: bool = typer.Option(False, "--online", help="Run the target in this job (no store)."),
        layers: str = typer.Option(None, help="Aux layer ids (default 2,N/2,N-3 online; offline: the store's, checked if given)."),
        ttt_steps: int = typer.Option(7, help="Training-time-test steps unrolled per position."),
        step_decay: float = typer.Option(0.8, help="Loss weight of TTT step j is step_decay**j."),
        lr: float = typer.Option(1e-4, help="Peak learning rate (AdamW)."),
        epochs: int = typer.Option(1, help="Passes over the training split (ignored with --max-steps)."),
        max_steps: int = typer.Option(None, help="Optimizer steps to run (overrides --epochs)."),
        max_train_seconds: float = typer.Option(
            None, help="Stop once this many seconds of training have passed after the first step "
                       "(set-up and compilation not counted) and write the draft; the LR schedule "
                       "is still the one of --max-steps/--epochs."),
        tokens_per_batch: int = typer.Option(2048, help="Tokens per pack (documents packed, no cross-attention)."),
        batch_size: int = typer.Option(1, help="Packs per micro-batch."),
        grad_accum: int = typer.Option(1, help="Micro-batches per optimizer step (per process)."),
        warmup: int = typer.Option(50, help="Linear warmup steps, then cosine decay."),
        clip: float = typer.Option(0.5, help="Gradient-norm clip (0 = off)."),
        max_nonfinite_steps: int = typer.Option(3, help="A step with a non-finite loss or gradient norm is "
                                                "skipped (not applied); this many in a row stop the run "
                                                "with an error naming the step and its samples."),
        weight_decay: float = typer.Option(0.0, help="Weight decay (AdamW, and Muon with --optimizer muon)."),
        optimizer: str = typer.Option("adamw", help="adamw, or muon: Muon (torch.optim.Muon, RMS-matched "
                                      "to AdamW's lr) for the layer's and fc's matrices, AdamW for lm_head "
                                      "and norms."),
        save_every: int = typer.Option(500, help="Checkpoint every N optimizer steps (atomic)."),
        eval_every: int = typer.Option(200, help="Held-out acceptance proxy every N steps (0 = only at the end)."),
        eval_batches: int = typer.Option(8, help="Held-out micro-batches per evaluation."),
        heldout: float = typer.Option(0.02, help="Fraction of samples held out (by index hash)."),
        resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --out."),
        device: str = typer.Option("auto", help="cuda, cpu or auto (torchrun: one GPU per process)."),
        precision: str = typer.Option("auto", help="bf16 (autocast), fp32, or auto (bf16 on GPU)."),
        seed: int = typer.Option(0, help="Seed for init and data order."),
        draft_config: str = typer.Option(None, help="Draft overrides, e.g. 'intermediate_size=2048,rope_theta=1e6'."),
        compile: bool = typer.Option(False, "--compile", help="torch.compile the draft's TTT forward and the loss."),
        compile_scope: str = typer.Option("model", help="With --compile: model (the whole TTT forward in one "
                                          "graph: the fastest steps measured, a longer cold compile) or regions "
                                          "(each TTT step's two dense regions: 30 s cold on an H200, slower "
                                          "steps). Numbers: benchmarks/train_bench.md."),
        compile_mode: str = typer.Option("default", help="With --compile --compile-scope model: torch.compile's "
                                         "mode: default, reduce-overhead (CUDA graphs) or "
                                         "max-autotune-no-cudagraphs."),
        fused_loss: bool = typer.Option(False, "--fused-loss", help="lm_head, the target distribution and "
                                        "the cross entropy chunked over the positions the loss counts: "
                                        "no [tokens, vocab] tensors kept, same loss and gradients."),
        loss_chunk: int = typer.Option(4096, help="With --fused-loss: rows per chunk (each chunk's fp32 "
                                       "temporaries are [rows, draft vocab])."),
        log_every: int = typer.Option(1, help="Write a training record (metrics.jsonl, TensorBoard) every N steps."),
        parallel: str = typer.Option("ddp", help="ddp or fsdp2 (sharded params, grads and optimizer "
                                     "state); only used when torchrun starts more than one process."),
        attention: str = typer.Option("auto", help="TTT attention kernel: dense, flex (block-sparse "
                                      "flex_attention, compiled; CUDA only for training) or auto "
                                      "(flex on CUDA, dense elsewhere)."),
    ) -> None:
        """Train an EAGLE-3 draft with training-time test (offline from a store, or --online)."""
        from rich.console import Console

        from eyas.features.layers import parse_layers
        from eyas.train.trainer import TrainConfig, train as run

        cfg = TrainConfig(target=target, data=str(data), out=str(out), store=str(store) if store else None,
                          online=online, layers=parse_layers(layers), ttt_steps=ttt_steps,
                          step_decay=step_decay, lr=lr, epochs=epochs, max_steps=max_steps, max_train_seconds=max_train_seconds,
                          tokens_per_batch=tokens_per_batch, batch_size=batch_size, grad_accum=grad_accum,
                          warmup=warmup, clip=clip, max_nonfinite_steps=max_nonfinite_steps, weight_decay=weight_decay, optimizer=optimizer, save_every=save_every,
                          eval_every=eval_every, eval_batches=eval_batches, heldout_fraction=heldout,
                          resume=resume, device=device, precision=precision, seed=seed,
                          draft_overrides=_overrides(draft_config), compile=compile, compile_scope=compile_scope,
                          compile_mode=compile_mode, fused_loss=fused_loss, loss_chunk=loss_chunk,
                          log_every=log_every, parallel=parallel, attention=attention)
        draft = run(cfg)
        console = Console(stderr=True)
        console.print(f"draft -> {draft}")
        pred = Path(draft) / PREDICTION_FILE
        if pred.is_file():
            taus = json.loads(pred.read_text())["predicted_tau"]
            console.print("predicted tau (held-out agreement, chain): "
                          + ", ".join(f"k={k} {t:.2f}" for k, t in taus.items()))
