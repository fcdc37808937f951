"""The `eyas export` command, generated from :class:`eyas.export.config.ExportConfig`."""

from __future__ import annotations

import typer

from eyas.export.config import ExportConfig
from eyas.settings import command


def _run(cfg: ExportConfig) -> None:
    """Export a trained draft for vLLM (speculators format) or SGLang (EAGLE-3 format)."""
    from eyas.export.run import export

    path = export(cfg)
    typer.echo(f"wrote {cfg.format} draft to {path}, with its model card {path / 'README.md'}")


def register(app: typer.Typer) -> None:
    command(app, "export", ExportConfig, _run, positional=("ckpt",))
