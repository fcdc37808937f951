"""The `eyas prepare` command, generated from :class:`eyas.data.config.PrepareOptions` (with
:class:`~eyas.data.config.RegenerateOptions` behind ``--regenerate``)."""

from __future__ import annotations

import typer

from eyas.data.config import PrepareOptions
from eyas.settings import command


def _run(opts: PrepareOptions) -> None:
    """Render conversations with the target's chat template, mask assistant tokens, build the draft vocab."""
    from rich.console import Console

    from eyas.data.prepare import prepare, summary_lines

    console = Console(stderr=True)
    manifest = prepare(opts, log=lambda s: console.print(s, soft_wrap=True, markup=False))
    for line in summary_lines(manifest):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    console.print(f"[green]prepared dataset:[/green] {opts.out} ({manifest['seconds']} s)")


def register(app: typer.Typer) -> None:
    command(app, "prepare", PrepareOptions, _run)
