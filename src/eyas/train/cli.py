"""The `eyas train` command (works the same under `torchrun ... -m eyas.cli train`): generated from
:class:`eyas.train.config.TrainConfig`, one option per field."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from eyas.settings import command
from eyas.train.config import TrainConfig
from eyas.train.tau import TAU_FILE


def _run(cfg: TrainConfig) -> None:
    """Train an EAGLE-3 draft with training-time test (offline from a store, or --online)."""
    from rich.console import Console

    from eyas.train.trainer import train

    console = Console(stderr=True)
    draft = train(cfg)
    console.print(f"draft -> {draft}")
    measured = Path(draft) / TAU_FILE
    if measured.is_file():
        m = json.loads(measured.read_text())
        console.print(f"tau by replay on {m['turns']} turns of {m['prompts']} ({m['max_new_tokens']} tokens, "
                      f"step {m['step']}): " + ", ".join(f"k={k} {t:.3f}" for k, t in m["tau"].items() if t))


def register(app: typer.Typer) -> None:
    command(app, "train", TrainConfig, _run)
