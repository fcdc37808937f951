"""Where eyas keeps what it makes once and reuses: converted targets, downloaded packages and data,
the GGUF weight records, compile caches, the target's replay answers."""

from __future__ import annotations

import os
from pathlib import Path

from eyas.errors import EyasError


def cache_dir() -> Path:
    """Where eyas keeps converted targets and downloaded packages (``EYAS_CACHE`` overrides); a
    path that exists and is not a folder is refused here, before a stage writes under it."""
    path = Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas")).expanduser()
    if path.exists() and not path.is_dir():
        var = "EYAS_CACHE" if os.environ.get("EYAS_CACHE") else "the default cache"
        raise EyasError(
            f"{var} {path} is a file, not a folder; point EYAS_CACHE at a folder (or unset it for ~/.cache/eyas)"
        )
    return path
