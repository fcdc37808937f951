"""The `eyas evaluate` command, generated from :class:`eyas.evaluate.config.EvaluateConfig`."""

from __future__ import annotations

import typer

from eyas.evaluate.config import EvaluateConfig
from eyas.settings import command


def _run(cfg: EvaluateConfig) -> None:
    """Measure a draft: tau (tokens per target forward), acceptance per draft position, speed."""
    from eyas.evaluate.run import evaluate

    reports = evaluate(cfg)
    _echo(reports, "")
    for other in cfg.also_k:
        if f"k{other}" in reports:
            _echo(reports[f"k{other}"], f"k={other} ")
    speed = reports.get("vllm", {}).get("serving_speed")
    for d, p in zip(*(speed[x] for x in ("draft", "plain"))) if speed else ():
        typer.echo(f"vllm serving, {d['concurrency']} concurrent: {d['tokens_per_s']:.0f} tok/s with the "
                   f"draft, {p['tokens_per_s']:.0f} without ({d['tokens_per_s'] / p['tokens_per_s']:.2f}x)")
    typer.echo(f"reports in {cfg.out}")


def _echo(reports: dict, label: str) -> None:
    for name in ("builtin", "vllm"):
        if name in reports:
            o = reports[name]["overall"]
            rates = ", ".join(f"{r:.2f}" for r in o["acceptance_rate_per_pos"] if r is not None)
            tau = "n/a (no draft rounds)" if o["tau"] is None else f"{o['tau']:.3f}"
            line = f"{label}{name}: tau {tau}  acceptance/pos [{rates}]"
            if reports[name].get("predicted_tau") is not None:
                line += f"  (predicted by training: {reports[name]['predicted_tau']:.3f})"
            if o.get("tokens_per_s"):
                line += f"  {o['tokens_per_s']:.1f} tok/s"
            if o.get("speedup"):
                line += f"  speedup {o['speedup']:.2f}x"
            typer.echo(line)
    if "comparison" in reports:
        c = reports["comparison"]
        if c["tau_relative_difference"] is not None:
            typer.echo(f"{label}tau builtin vs vllm: relative difference {c['tau_relative_difference']:.3f}, "
                       f"identical outputs {c['identical_outputs']}/{c['prompts']}")


def register(app: typer.Typer) -> None:
    command(app, "evaluate", EvaluateConfig, _run)
