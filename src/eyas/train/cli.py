"""The `eyas train` command (works the same under `torchrun ... -m eyas.cli train`): generated from
:class:`eyas.train.config.TrainConfig`, one option per field."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from eyas.settings import command
from eyas.train.config import TrainConfig
from eyas.train.predict import PREDICTION_FILE


def _run(cfg: TrainConfig) -> None:
    """Train an EAGLE-3 draft with training-time test (offline from a store, or --online)."""
    from rich.console import Console

    from eyas.train.trainer import train

    console = Console(stderr=True)
    draft = train(cfg)
    console.print(f"draft -> {draft}")
    pred = Path(draft) / PREDICTION_FILE
    if pred.is_file():
        rec = json.loads(pred.read_text())
        if "measured_tau" in rec:
            m = rec["measured_tau"]
            console.print(f"tau by replay on {m['turns']} turns of {m['prompts']} ({m['max_new_tokens']} tokens, "
                          f"step {m['step']}): " + ", ".join(f"k={k} {t:.3f}" for k, t in m["tau"].items() if t))
        if "predicted_tau" not in rec:
            return
        console.print("predicted tau (held-out agreement, chain): "
                      + ", ".join(f"k={k} {t:.2f}" for k, t in rec["predicted_tau"].items()))
        if "predicted_tau_first" in rec:
            console.print(f"  over the first {rec['horizon']} tokens of each answer: "
                          + ", ".join(f"k={k} {t:.2f}" for k, t in rec["predicted_tau_first"].items()))
        for key, what in (("replayed_tau", "the loop replayed over held-out answers"),
                          ("replayed_tau_first", f"over their first {rec.get('horizon')} tokens")):
            if key in rec:
                console.print(f"tau, {what}: " + ", ".join(
                    f"k={k} {'n/a' if t is None else f'{t:.2f}'}" for k, t in rec[key].items()))


def register(app: typer.Typer) -> None:
    command(app, "train", TrainConfig, _run)
