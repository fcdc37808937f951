"""The `eyas extract` command, generated from :class:`eyas.extract.config.ExtractConfig`."""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.extract.config import ExtractConfig
from eyas.settings import command


def _verify(verify: Path | None = None) -> bool:
    """``--verify STORE``: only re-check an existing store (exit 1 on a problem)."""
    if verify is None:
        return False
    from rich.console import Console

    from eyas.extract.store import verify_store

    console = Console(stderr=True)
    problems = verify_store(verify, progress=True)
    for p in problems:
        console.print(f"[red]problem:[/red] {p}")
    if problems:
        raise typer.Exit(1)
    console.print(f"store {verify}: all shards, checksums and shapes OK")
    return True


def _run(cfg: ExtractConfig, verify: Path | None = None) -> None:
    """Run the target over a prepared dataset and store aux + final hidden states."""
    from rich.console import Console

    from eyas.extract.run import extract

    s = extract(cfg)
    Console(stderr=True).print(
        f"stored {s['samples']} samples ({s['resumed_from']} were already there): {s['tokens']:,} tokens "
        f"this run, {s['bytes'] / 1e9:.3f} GB, {s['bytes_per_token']:.0f} B/token, {s['seconds']:.1f} s, "
        f"{s['tokens_per_s']:,.0f} tokens/s -> {cfg.out}")


def register(app: typer.Typer) -> None:
    command(app, "extract", ExtractConfig, _run, loose=("data", "out"), intercept=_verify,
            missing="eyas extract needs --data PREPARED_DIR and --out STORE (or --verify STORE)",
            extra={"verify": (Path | None, typer.Option(None, "--verify", help="Only re-check an existing "
                                                        "store and exit."))})
