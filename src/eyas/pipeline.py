"""`eyas pipeline [CONFIG]`: prepare -> (extract) -> train -> export -> evaluate, resumable.

Every stage writes into ``workdir/<stage>`` and is itself idempotent (a complete output is
checked and skipped, an interrupted one resumed), so the pipeline simply runs each stage in
order; re-running after a crash continues where it stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from eyas.config import PipelineConfig, load_config
from eyas.errors import EyasError

console = Console(stderr=True)


def run_pipeline(cfg: PipelineConfig) -> dict[str, Any]:
    """Run every stage of ``cfg``; returns the evaluation report (a dict)."""
    from eyas.data.prepare import PrepareOptions, RegenerateOptions, prepare
    from eyas.export.cli import export_checkpoint
    from eyas.target import resolve_target

    work = cfg.workdir
    work.mkdir(parents=True, exist_ok=True)
    (work / "pipeline-config.json").write_text(json.dumps(
        {"source": cfg.source, "target": cfg.target, "features": cfg.features,
         "launcher": cfg.launcher, "sections": cfg.sections}, indent=2, default=str))
    timings: dict[str, float] = {}
    resolve_target(cfg.target)  # converts a built-in target once, up front
    console.rule(f"eyas pipeline: target {cfg.target} -> {work}")

    t = time.perf_counter()
    prep = cfg.section("prepare")
    regen = prep.pop("regenerate", None)
    if regen is True:
        regen = {}
    prepared = work / "prepared"
    if isinstance(prep.get("data"), str):
        prep["data"] = [prep["data"]]
    if prep.get("chat_template"):
        prep["chat_template"] = Path(prep["chat_template"])
    prepare(PrepareOptions(out=prepared, target=cfg.target,
                           regenerate=RegenerateOptions(**regen) if isinstance(regen, dict) else None,
                           **prep),
            log=lambda msg: console.print(f"[dim]prepare[/dim] {msg}"))
    timings["prepare"] = time.perf_counter() - t

    store = None
    if cfg.features == "offline":
        from eyas.extract.run import run_extract

        t = time.perf_counter()
        store = work / "store"
        console.rule("extract")
        run_extract(cfg.target, prepared, store, **cfg.section("extract"))
        timings["extract"] = time.perf_counter() - t

    t = time.perf_counter()
    console.rule("train")
    run_dir = work / "train"
    draft = run_dir / "draft"
    if (draft / "model.safetensors").is_file() and (draft / "config.json").is_file():
        console.print(f"train: {draft} exists, skipping (delete it to train again)")
    else:
        _train(cfg, prepared, store, run_dir)
    timings["train"] = time.perf_counter() - t

    t = time.perf_counter()
    console.rule("export")
    exp = cfg.section("export")
    fmt = exp.pop("fmt", "vllm")
    exported = work / f"export-{fmt}"
    export_checkpoint(draft, fmt, exported, cfg.target, overwrite=True, **exp)
    timings["export"] = time.perf_counter() - t

    t = time.perf_counter()
    console.rule("evaluate")
    from eyas.evaluate.cli import evaluate_draft

    ev = cfg.section("evaluate")
    if "prompts" in ev:
        ev["prompts"] = Path(ev["prompts"])
    report = evaluate_draft(cfg.target, draft, out=work / "eval", **ev)
    timings["evaluate"] = time.perf_counter() - t
    (work / "pipeline-timings.json").write_text(json.dumps(timings, indent=2))
    console.print(f"pipeline done in {sum(timings.values()):.0f} s: "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    for engine, rep in report.items():
        overall = rep.get("overall") if isinstance(rep, dict) else None
        if not overall:
            continue
        rates = ", ".join(f"{r:.3f}" for r in overall.get("acceptance_rate_per_pos", []))
        console.print(f"[bold]{engine}[/bold]: tau {overall['tau']:.3f} tokens per target forward, "
                      f"acceptance per draft position [{rates}], speedup "
                      f"{overall.get('speedup') or float('nan'):.2f}x -> {work / 'eval' / engine}/"
                      "report.json, acceptance_per_position.png, tau_per_category.png")
    return report


def _train(cfg: PipelineConfig, prepared: Path, store: Path | None, run_dir: Path) -> None:
    from eyas.train.trainer import TrainConfig, train

    resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    tc = TrainConfig(target=cfg.target, data=str(prepared), out=str(run_dir),
                     store=str(store) if store else None, online=store is None, resume=resume,
                     **cfg.section("train"))
    nproc = int(cfg.launcher.get("nproc_per_node", 1))
    if nproc <= 1 and int(cfg.launcher.get("nnodes", 1)) <= 1:
        train(tc)
        return
    # Several processes: torchrun launches them; each reads the same TrainConfig.
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = run_dir / "train-config.json"
    spec.write_text(json.dumps(asdict(tc), default=str))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--nnodes={cfg.launcher.get('nnodes', 1)}"]
    if "rdzv_endpoint" in cfg.launcher:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.launcher['rdzv_endpoint']}"]
    if "node_rank" in cfg.launcher:
        cmd += [f"--node-rank={cfg.launcher['node_rank']}"]
    cmd += ["-m", "eyas.pipeline", str(spec)]
    console.print("train: " + " ".join(cmd))
    res = subprocess.run(cmd)
    if res.returncode != 0:
        raise EyasError(f"torchrun training exited with {res.returncode}; fix the error above and "
                        "re-run `eyas pipeline` (training resumes from its last checkpoint)")


def _train_from_spec(path: str) -> None:
    """Entry point for each torchrun process."""
    from eyas.train.trainer import TrainConfig, train

    data = json.loads(Path(path).read_text())
    if isinstance(data.get("betas"), list):
        data["betas"] = tuple(data["betas"])
    train(TrainConfig(**data))


def register(app: typer.Typer) -> None:
    @app.command()
    def pipeline(
        config: Path = typer.Argument(None, help="YAML config (see configs/); default: the built-in "
                                      "CPU job on SmolLM2-135M-Instruct and ShareGPT."),
        workdir: Path = typer.Option(None, help="Override the config's workdir."),
        print_config: bool = typer.Option(False, "--print-config", help="Print the default config and exit."),
    ) -> None:
        """Run the whole job: prepare, (extract), train, export, evaluate. Re-run to resume."""
        from eyas.config import default_config_text

        if print_config:
            print(default_config_text())
            return
        cfg = load_config(config)
        if workdir is not None:
            cfg.workdir = workdir
        run_pipeline(cfg)


if __name__ == "__main__":
    _train_from_spec(sys.argv[1])
