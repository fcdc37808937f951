"""Manifests: a JSON file beside every stage's output that records what it was made from.

Later stages call :func:`check_matches` so that data from another target, tokenizer or layer
set is refused with a message naming the field, never silently mixed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from eyas.errors import EyasError

MANIFEST = "manifest.json"


def write_manifest(directory: Path, data: dict[str, Any], name: str = MANIFEST) -> Path:
    """Write ``data`` atomically (temp file + rename), so a crash never leaves half a manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    tmp = path.with_name(f".{name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(directory: Path, name: str = MANIFEST, what: str = "directory") -> dict[str, Any]:
    path = Path(directory) / name
    if not path.is_file():
        raise EyasError(f"{what} {directory}: no {name}; it was not made by eyas or is incomplete")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EyasError(f"{path}: not valid JSON ({e}); remove the directory and re-run the stage") from e


def check_matches(
    found: dict[str, Any], expected: dict[str, Any], keys: Iterable[str], where: str, fix: str = ""
) -> None:
    """Raise naming every key whose value in ``found`` differs from ``expected``."""
    diffs = [f"{k}: {found.get(k)!r} there, {expected.get(k)!r} here" for k in keys if found.get(k) != expected.get(k)]
    if diffs:
        msg = f"{where} does not match: " + "; ".join(diffs)
        raise EyasError(msg + (f". {fix}" if fix else ""))
