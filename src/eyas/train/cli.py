"""The `eyas train` command (works the same under `torchrun ... -m eyas.cli train`): generated from
:class:`eyas.train.config.TrainConfig`, one option per field."""

from __future__ import annotations

import typer

from eyas.settings import command
from eyas.train.config import TrainConfig


def _run(cfg: TrainConfig) -> None:
    """Train an EAGLE-3 draft with training-time test (offline from a store, or --online)."""
    from rich.console import Console

    from eyas.train.trainer import train

    draft = train(cfg)
    Console(stderr=True).print(f"draft -> {draft}")


def register(app: typer.Typer) -> None:
    command(app, "train", TrainConfig, _run)
