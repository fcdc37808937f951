"""The `eyas evaluate` command, generated from :class:`eyas.evaluate.config.EvaluateConfig`."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.evaluate.config import EvaluateConfig
from eyas.settings import command


def _run(cfg: EvaluateConfig) -> Path:
    """Measure a draft: tau (tokens per target forward), acceptance per draft position, speed."""
    from eyas.evaluate.run import run  # imported when the command runs: `eyas --help` stays quick

    return run(cfg)


def register(app: typer.Typer) -> None:
    command(app, "evaluate", EvaluateConfig, _run)
