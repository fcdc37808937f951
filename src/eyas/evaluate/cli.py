"""The `eyas evaluate` command, generated from :class:`eyas.evaluate.config.EvaluateConfig`."""

from __future__ import annotations

import typer

from eyas.evaluate.config import EvaluateConfig
from eyas.settings import command


def _run(cfg: EvaluateConfig) -> None:
    """Measure a draft: tau (tokens per target forward), acceptance per draft position, speed."""
    from eyas.evaluate.report import summary_lines
    from eyas.evaluate.run import evaluate

    for line in summary_lines(evaluate(cfg), cfg.out):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    command(app, "evaluate", EvaluateConfig, _run)
