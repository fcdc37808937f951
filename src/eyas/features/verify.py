"""Checking a hidden-state store: checksums, tensor names/dtypes/shapes, the sample table, fp8 scales."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from eyas.errors import EyasError
from eyas.features.format import KIND, check_format, file_checksum, hasher_for, layout_of, read_header
from eyas.fsio import inside
from eyas.manifest import MANIFEST, read_manifest


def shard_problem(path: Path, record: dict[str, Any]) -> str | None:
    """What is wrong with the shard file ``record`` describes (missing, size, checksum), or None.
    Reads the whole file once (xxh3: GB/s). A ``file`` that is not a plain name in the store is an
    EyasError: nothing outside the store is opened."""
    f = inside(Path(path), record.get("file"), "store")
    if not f.is_file():
        return "missing"
    size = f.stat().st_size
    if size != record["bytes"]:
        return f"{size} bytes, its record says {record['bytes']}"
    digest = file_checksum(f, record["checksum"]["algo"])
    if digest != record["checksum"]["digest"]:
        return f"checksum {digest}, its record says {record['checksum']['digest']}"
    return None


def changed_tensors(f: Path, record: dict[str, Any], header: dict[str, Any], data_start: int) -> list[str]:
    """The tensors whose bytes differ from the per-tensor checksums in ``record``."""
    want = record["tensor_checksums"]
    changed = []
    with open(f, "rb") as fh:
        for name, digest in want.items():
            spec = header.get(name)
            if spec is None:
                changed.append(name)
                continue
            a, b = spec["data_offsets"]
            fh.seek(data_start + a)
            h = hasher_for(record["checksum"]["algo"])
            left = b - a
            while left > 0:
                chunk = fh.read(min(left, 16 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            if left or h.hexdigest() != digest:
                changed.append(name)
    return changed


def scale_problem(f: Path, header: dict[str, Any], data_start: int) -> str | None:
    """An fp8 shard's scales must be finite and >= 0 (amax / 448): a scale that is not decodes every
    value of its group wrong, however consistent the checksums are."""
    spec = header["hidden_scale"]
    a, b = spec["data_offsets"]
    scale = np.fromfile(f, dtype="<f4", count=(b - a) // 4, offset=data_start + a)
    bad = ~np.isfinite(scale) | (scale < 0)
    if not bad.any():
        return None
    n, s, g = spec["shape"]
    tok, slot, _ = np.unravel_index(int(np.argmax(bad)), (n, s, g))
    return (
        f"tensor hidden_scale: {int(bad.sum())} scale(s) non-finite or negative (first at token "
        f"{tok}, slot {slot}: {float(scale[int(np.argmax(bad))])}); every value of such a group decodes wrong"
    )


def verify_store(path: str | os.PathLike, progress: bool = False) -> list[str]:
    """Re-check every shard's checksum (per tensor where recorded), header shapes/dtypes, fp8
    scales and the sample table; list the problems (empty: the store is sound)."""
    path = Path(path)
    problems: list[str] = []
    try:
        manifest = read_manifest(path, what="store")
    except EyasError as e:
        return [str(e)]
    if manifest.get("kind") != KIND:
        return [f"{path}/{MANIFEST}: kind {manifest.get('kind')!r}, expected {KIND!r}"]
    if not manifest.get("complete"):
        problems.append(
            f"{path}: the manifest is not marked complete (interrupted run); re-run "
            "`eyas extract` with the same arguments"
        )
    if "samples" not in manifest:
        return problems
    try:
        check_format(manifest, f"store {path}")
        layout = layout_of(manifest, f"store {path}")
    except EyasError as e:
        return problems + [str(e)]
    idx = manifest["samples"]["index"]
    n = int(manifest.get("num_samples", len(idx)))
    if sorted(idx) != list(range(n)):
        seen = set(idx)
        dup = len(idx) - len(seen)
        missing = [i for i in range(n) if i not in seen][:10]
        problems.append(f"sample table: {dup} duplicated, missing {missing} (of {n})")
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for sid, off, ln in zip(manifest["samples"]["shard"], manifest["samples"]["offset"], manifest["samples"]["length"]):
        by_shard.setdefault(int(sid), []).append((int(off), int(ln)))
    shards = manifest.get("shards", [])
    it = shards
    if progress:
        from tqdm import tqdm

        it = tqdm(shards, desc="verify", unit="shard")
    for s in it:
        try:
            f = inside(path, s.get("file"), "store")
        except EyasError as e:
            problems.append(str(e))
            continue
        if not f.is_file():
            problems.append(f"{s['file']}: missing")
            continue
        if f.stat().st_size != s["bytes"]:
            problems.append(f"{s['file']}: {f.stat().st_size} bytes, the manifest says {s['bytes']}")
            continue
        try:
            data_start, header = read_header(f)
        except (ValueError, OSError) as e:
            header, data_start = None, 0
            header_error = f"unreadable safetensors header ({e})"
        digest = file_checksum(f, s["checksum"]["algo"])
        if digest != s["checksum"]["digest"]:
            which = changed_tensors(f, s, header, data_start) if header is not None else []
            where = f" in tensor {', '.join(which)}" if which else ""
            problems.append(f"{s['file']}: checksum {digest} != {s['checksum']['digest']} (corrupted{where})")
            continue
        if header is None:
            problems.append(f"{s['file']}: {header_error}")
            continue
        ntok = s["tokens"]
        for name, dt, shape, _ in layout.tensors(ntok):
            got = header.get(name)
            if got is None or got["dtype"] != dt or got["shape"] != shape:
                problems.append(
                    f"{s['file']}: tensor {name} is "
                    f"{(got or {}).get('dtype')} {(got or {}).get('shape')}, expected {dt} {shape}"
                )
        extra = sorted(set(header) - {"__metadata__"} - {t[0] for t in layout.tensors(ntok)})
        if extra:
            problems.append(f"{s['file']}: tensors {extra} that a {layout.dtype} store does not hold")
        if (
            layout.quantized
            and "hidden_scale" in header
            and not any(p.startswith(f"{s['file']}: tensor hidden_scale") for p in problems)
        ):
            bad = scale_problem(f, header, data_start)
            if bad:
                problems.append(f"{s['file']}: {bad}")
        spans = sorted(by_shard.get(int(s["shard"]), []))
        end = 0
        for off, ln in spans:
            if off != end:
                problems.append(f"{s['file']}: samples overlap or leave a gap at token {off}")
                break
            end = off + ln
        if end != ntok:
            problems.append(f"{s['file']}: samples cover {end} tokens, the shard holds {ntok}")
    return problems
