"""The `eyas` command: one sub-command per pipeline stage."""

from __future__ import annotations

import importlib
import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from eyas.errors import EyasError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train EAGLE-3 draft models for a target LLM and serve them with vLLM.")
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """eyas: prepare -> extract -> train -> export -> evaluate."""

# Each stage module exposes register(app); listed here in pipeline order.
STAGE_MODULES = [
    "eyas.data.cli",
    "eyas.extract.cli",
    "eyas.train.cli",
    "eyas.export.cli",
    "eyas.evaluate.cli",
    "eyas.pipeline",
]


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON.")) -> None:
    """Show versions, devices, and which extraction backends are usable here (and why not)."""
    from eyas.doctor import collect

    info = collect()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    out = Console()
    for key in ("python", "platform", "torch", "transformers", "vllm", "cuda"):
        out.print(f"[bold]{key:13}[/bold] {info[key] or 'not installed'}")
    out.print(f"[bold]{'devices':13}[/bold] {', '.join(info['devices'])}")
    table = Table("backend", "usable", "reason", title="extraction backends")
    for b in info["backends"]:
        table.add_row(b["name"], "yes" if b["usable"] else "no", b["reason"])
    out.print(table)
    auto = info["auto"]
    if auto.get("vllm"):
        flag = "[bold yellow]UNTESTED[/bold yellow] " if not auto["tested"] else ""
        out.print(f"[bold]{'--backend auto':13}[/bold] {auto['backend']} with vLLM {auto['vllm']} "
                  f"({auto['python']}): {flag}{auto['note']}")
        if not auto["tested"]:
            from eyas.extract.selfcheck import DEFAULT_SAMPLES

            out.print(" " * 14 + f"eyas extract first compares the first {DEFAULT_SAMPLES} samples' states with "
                      "--backend hf and stops on a mismatch (--self-check N; 0 skips it)")
    else:
        out.print(f"[bold]{'--backend auto':13}[/bold] {auto['backend'] or 'none'}: {auto['why']}")


for _mod in STAGE_MODULES:
    importlib.import_module(_mod).register(app)


def main() -> None:
    try:
        app()
    except EyasError as e:
        console.print(f"[bold red]error:[/bold red] {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()
