"""The `eyas extract` command, generated from :class:`eyas.extract.config.ExtractConfig`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from eyas.extract.config import ExtractConfig
from eyas.settings import command


def _verify(verify: Path | None = None, against: Path | None = None, min_cosine: float = 0.99) -> bool:
    """``--verify STORE [--against REF]``: only re-check an existing store, and compare its states
    with a reference store's (exit 1 on a problem or a token below ``min_cosine``)."""
    if verify is None:
        return False
    from rich.console import Console

    from eyas.features.format import FP8
    from eyas.features.verify import verify_store

    console = Console(stderr=True)
    problems = verify_store(verify, progress=True)
    for p in problems:
        console.print(f"[red]problem:[/red] {p}")
    if problems:
        raise typer.Exit(1)
    fp8 = json.loads((Path(verify) / "manifest.json").read_text()).get("dtype") == FP8
    console.print(
        f"store {verify}: all shards, checksums and shapes OK" + ("; every fp8 scale finite and >= 0" if fp8 else "")
    )
    if against is None:
        return True
    from eyas.device import resolve_device
    from eyas.features.compare import compare_stores

    rep = compare_stores(verify, against, min_cosine, device=resolve_device("auto"))
    for sl in rep["slots"]:
        console.print(
            f"  {sl['slot']}: min cosine {sl['min_cosine']:.5f} (sample {sl['worst_sample']}, "
            f"token {sl['worst_token']}), mean {sl['mean_cosine']:.6f}, {sl['tokens_below']} "
            f"tokens below {min_cosine}"
        )
    verdict = "every token" if rep["ok"] else f"{rep['rows_below']} samples have tokens"
    console.print(
        f"against {against}: {rep['samples']} samples, {rep['tokens']:,} tokens; "
        f"{verdict} {'at or above' if rep['ok'] else 'below'} cosine {min_cosine}"
    )
    typer.echo(json.dumps(rep))  # stdout: the report, for scripts
    if not rep["ok"]:
        raise typer.Exit(1)
    return True


def _run(cfg: ExtractConfig) -> Path:
    """Run the target over a prepared dataset and store aux + final hidden states."""
    from eyas.extract.run import run  # imported when the command runs: `eyas --help` stays quick

    return run(cfg)


def register(app: typer.Typer) -> None:
    command(
        app,
        "extract",
        ExtractConfig,
        _run,
        loose=("data", "out"),
        intercept=_verify,
        missing="eyas extract needs --data PREPARED_DIR and --out STORE (or --verify STORE)",
        extra={
            "verify": (Path | None, typer.Option(None, "--verify", help="Only re-check an existing store and exit.")),
            "against": (
                Path | None,
                typer.Option(
                    None,
                    "--against",
                    help="With --verify: also compare "
                    "its states with this reference store of the same "
                    "data (e.g. made with --backend hf), token by token; "
                    "prints a JSON report on stdout.",
                ),
            ),
            "min_cosine": (
                float,
                typer.Option(
                    0.99, "--min-cosine", help="With --against: the cosine every token of every slot must reach."
                ),
            ),
        },
    )
