"""The `eyas` command: one sub-command per pipeline stage."""

from __future__ import annotations

import errno
import importlib
import json
import os
import sys
import traceback
import warnings

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from eyas.errors import EyasError, show_warning

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train EAGLE-3 draft models for a target LLM and serve them with vLLM.",
)
console = Console(stderr=True)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="On an error, also print its traceback (or set EYAS_DEBUG=1)."),
) -> None:
    """eyas: prepare -> extract -> train -> export -> evaluate."""
    if debug:
        os.environ["EYAS_DEBUG"] = "1"


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
        out.print(
            f"[bold]{'--backend auto':13}[/bold] {auto['backend']} with vLLM {auto['vllm']} "
            f"({auto['python']}): {flag}{auto['note']}"
        )
        if not auto["tested"]:
            from eyas.extract.selfcheck import DEFAULT_SAMPLES

            out.print(
                " " * 14 + f"eyas extract first compares the first {DEFAULT_SAMPLES} samples' states with "
                "--backend hf and stops on a mismatch (--self-check N; 0 skips it)"
            )
    else:
        out.print(f"[bold]{'--backend auto':13}[/bold] {auto['backend'] or 'none'}: {auto['why']}")


for _mod in STAGE_MODULES:
    importlib.import_module(_mod).register(app)


def _os_error_line(e: OSError) -> str:
    """One line for an OSError a stage did not foresee: the file, what the system said, what to do."""
    where = e.filename or "a file"
    if e.filename2:
        where = f"{e.filename} -> {e.filename2}"
    if e.errno == errno.ENOSPC:
        return (
            f"no space left on the device holding {where}: free space there (or choose an --out on "
            "another filesystem) and re-run the same command; it resumes where it stopped"
        )
    if e.errno == errno.EROFS:
        return f"{where} is on a read-only filesystem; choose an --out on a writable one"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"{where}: permission denied ({e.strerror}); choose a path this user may write, or fix its permissions"
    if e.errno == errno.EDQUOT:
        return f"{where}: disk quota exceeded; free space within your quota and re-run the same command"
    name = errno.errorcode.get(e.errno or 0, type(e).__name__)
    return f"{where}: {e.strerror or e} ({name})"


def error_line(e: BaseException) -> tuple[str, int]:
    """(the one line the user sees, the exit code) for an exception that ended a command: an
    EyasError's own message; an OSError's file and cause; anything else named as unexpected."""
    if isinstance(e, EyasError):
        return str(e), 2
    if isinstance(e, OSError):
        return _os_error_line(e), 2
    if isinstance(e, MemoryError):
        return (
            "out of memory; lower the batch size (--batch-tokens, --tokens-per-batch, --batch-size) "
            "or free memory, and re-run"
        ), 2
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return (
        f"unexpected {type(e).__name__}{': ' + first if first else ''}. This is a bug in eyas or an "
        "input it does not check yet: re-run with --debug for the traceback and report it"
    ), 1


def main(argv: list[str] | None = None) -> None:
    warnings.showwarning = show_warning  # eyas's warnings as one line each
    try:
        app(args=argv)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # Ctrl-C or a time limit's SIGINT: what was kept is said above, no traceback
        print("eyas: stopped by an interrupt", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - every error ends in one line; the traceback under --debug
        if os.environ.get("EYAS_DEBUG") not in (None, "", "0"):
            traceback.print_exception(e)
        line, code = error_line(e)
        console.print(f"[bold red]error:[/bold red] {escape(line)}", soft_wrap=True)
        sys.exit(code)


if __name__ == "__main__":
    main()
