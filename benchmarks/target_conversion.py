"""Time a built-in target's GGUF -> bf16 safetensors conversion, and check it against the one in
eyas's cache: every file's bytes and the target identity (which keys the answers kept in git).

    python benchmarks/target_conversion.py qwen2.5-coder-0.5b-instruct

The GGUF comes from the user cache (fetched there once); the conversion runs in a temporary cache.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eyas.cache import cache_dir
from eyas.fsio import sha256_file
from eyas.target import BUILTIN_TARGETS, resolve_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(BUILTIN_TARGETS))
    a = ap.parse_args()
    cached = resolve_target(a.name)  # the GGUF and the cached conversion to compare with
    gguf = cache_dir() / "gguf" / BUILTIN_TARGETS[a.name]["file"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "gguf").mkdir()
        (Path(tmp) / "gguf" / gguf.name).symlink_to(gguf)
        t0 = time.perf_counter()
        fresh = resolve_target(a.name, cache=Path(tmp))
        took = time.perf_counter() - t0
        files = sorted(p.name for p in cached.path.iterdir() if p.is_file() and not p.name.startswith("."))
        differ = [
            f
            for f in files
            if not (fresh.path / f).is_file() or sha256_file(fresh.path / f) != sha256_file(cached.path / f)
        ]
    print(f"{a.name}: converted in {took:.1f} s (with the identity and the weights' checksums)")
    print(f"files: {len(files) - len(differ)} of {len(files)} the same as the cache's", *differ)
    print(f"identity: {'the same' if fresh.identity == cached.identity else 'DIFFERENT'} ({fresh.identity['id']})")


if __name__ == "__main__":
    main()
