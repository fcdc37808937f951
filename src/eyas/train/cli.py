"""The `eyas train` command (works the same under `torchrun ... -m eyas.cli train`): generated from
:class:`eyas.train.config.TrainConfig`, one option per field."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.settings import command
from eyas.train.config import TrainConfig


def _run(cfg: TrainConfig) -> Path:
    """Train an EAGLE-3 draft with training-time test (--features offline from a store, online or vllm)."""
    from eyas.train.trainer import run  # imported when the command runs: `eyas --help` stays quick

    return run(cfg)


def register(app: typer.Typer) -> None:
    command(app, "train", TrainConfig, _run)
