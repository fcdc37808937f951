"""The `eyas export` command, generated from :class:`eyas.export.config.ExportConfig`."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.export.config import ExportConfig
from eyas.settings import command


def _run(cfg: ExportConfig) -> Path:
    """Export a trained draft for vLLM (speculators format) or SGLang (EAGLE-3 format)."""
    from eyas.export.run import run  # imported when the command runs: `eyas --help` stays quick

    return run(cfg)


def register(app: typer.Typer) -> None:
    command(app, "export", ExportConfig, _run, positional=("ckpt",))
