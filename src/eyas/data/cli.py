"""The `eyas prepare` command, generated from :class:`eyas.data.config.PrepareOptions` (with
:class:`~eyas.data.config.RegenerateOptions` behind ``--regenerate``)."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.data.config import PrepareOptions
from eyas.settings import command


def _run(cfg: PrepareOptions) -> Path:
    """Render conversations with the target's chat template, mask assistant tokens, build the draft vocab."""
    from eyas.data.prepare import run  # imported when the command runs: `eyas --help` stays quick

    return run(cfg)


def register(app: typer.Typer) -> None:
    command(app, "prepare", PrepareOptions, _run)
