"""The prepared-dataset format (interface A): parquet shards + draft vocab + manifest.

Layout of a prepared directory::

    manifest.json             kind "eyas-prepared", target identity, template hash, counts, ...
    shard-00000.parquet ...   columns input_ids list<int32>, loss_mask list<int8>, source_id string
    draft_vocab.safetensors   d2t int64 [draft_vocab_size], t2d bool [target vocab]

``manifest.json`` is written last, so its presence means the directory is complete. The read
path uses pyarrow only (the GPU machine has no ``datasets``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eyas.errors import EyasError
from eyas.fsio import inside
from eyas.manifest import MANIFEST, read_manifest, write_manifest

KIND = "eyas-prepared"
FORMAT_VERSION = 1
VOCAB_FILE = "draft_vocab.safetensors"
IDENTITY_KEYS = ("id", "config", "weights", "tokenizer")

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("source_id", pa.string()),
    ]
)


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.parquet"


def chat_template_sha256(template: str | None) -> str | None:
    """Hash of the chat template text (None when the tokenizer has none)."""
    if not template:
        return None
    return hashlib.sha256(template.encode()).hexdigest()


@dataclass(frozen=True)
class PreparedSample:
    index: int
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    source_id: str


# ------------------------------------------------------------------------------------- write


def write_shard(
    path: Path,
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    source_ids: Sequence[str],
    metadata: dict[str, Any] | None = None,
) -> int:
    """Write one parquet shard atomically (temp name + rename); returns the row count.

    ``metadata`` (JSON-serialisable) is stored in the parquet schema metadata under ``eyas``,
    so per-shard statistics land atomically with the rows they describe.
    """
    if not (len(input_ids) == len(loss_masks) == len(source_ids)):
        raise EyasError(
            f"write_shard {path}: {len(input_ids)} input_ids, {len(loss_masks)} loss_masks and "
            f"{len(source_ids)} source_ids; they must have one entry per sample"
        )
    for i, (ids, mask) in enumerate(zip(input_ids, loss_masks)):
        if len(ids) != len(mask):
            raise EyasError(
                f"write_shard {path}: sample {i} ({source_ids[i]!r}) has {len(ids)} input_ids but "
                f"{len(mask)} loss_mask entries; they must be equal"
            )
    schema = SCHEMA
    if metadata is not None:
        schema = SCHEMA.with_metadata({"eyas": json.dumps(metadata)})
    table = pa.Table.from_arrays(
        [
            pa.array(input_ids, type=pa.list_(pa.int32())),
            pa.array(loss_masks, type=pa.list_(pa.int8())),
            pa.array(list(source_ids), type=pa.string()),
        ],
        schema=schema,
    )
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return table.num_rows


def read_shard_metadata(path: Path) -> dict[str, Any] | None:
    """The ``eyas`` metadata stored by :func:`write_shard`, or None."""
    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(b"eyas")
    return json.loads(raw) if raw is not None else None


def save_draft_vocab(directory: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    d2t = torch.as_tensor(d2t).to(torch.int64).contiguous()
    t2d = torch.as_tensor(t2d).to(torch.bool).contiguous()
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise EyasError("draft vocab: d2t and t2d must be 1-D tensors")
    if int(t2d.sum()) != d2t.shape[0]:
        raise EyasError(
            f"draft vocab: t2d marks {int(t2d.sum())} target ids but d2t has {d2t.shape[0]} "
            "entries; they must describe the same set"
        )
    path = Path(directory) / VOCAB_FILE
    tmp = path.with_name(f".{VOCAB_FILE}.tmp{os.getpid()}")
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp))
    os.replace(tmp, path)
    return path


def finalize_manifest(
    directory: Path, target_identity: dict[str, str], shards: list[dict[str, Any]], fields: dict[str, Any]
) -> dict[str, Any]:
    """Write ``manifest.json`` (last step: it marks the directory complete)."""
    h = hashlib.sha256(json.dumps(target_identity, sort_keys=True).encode())
    for s in shards:
        h.update(s["file"].encode())
        with open(Path(directory) / s["file"], "rb") as fh:
            for chunk in iter(lambda: fh.read(16 << 20), b""):
                h.update(chunk)
    manifest = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "target": dict(target_identity),
        "shards": shards,
        "draft_vocab_file": VOCAB_FILE,
        **fields,
    }
    manifest["id"] = h.hexdigest()[:16]
    write_manifest(Path(directory), manifest)
    return manifest


def write_prepared(
    path: str | os.PathLike,
    input_ids: list[list[int]],
    loss_masks: list[list[int]],
    source_ids: list[str],
    target,
    d2t,
    t2d,
    extra_manifest: dict[str, Any] | None = None,
    shard_size: int = 4096,
) -> Path:
    """Write a complete prepared dataset in one go (used by tests and small tools).

    The directory is built under a temporary name and renamed into place, so it either exists
    complete or not at all. Refuses to overwrite an existing directory.
    """
    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise EyasError(f"write_prepared: {out} already exists and is not empty; pass a new path")
    extra = dict(extra_manifest or {})
    vocab_size = int(torch.as_tensor(t2d).shape[0])
    masks_np = [np.asarray(m, dtype=bool) for m in loss_masks]
    lengths = [len(x) for x in input_ids]
    trained = int(sum(int(m.sum()) for m in masks_np))
    if "coverage" not in extra:
        t2d_np = torch.as_tensor(t2d).numpy().astype(bool)
        inside = sum(int(t2d_np[np.asarray(ids, dtype=np.int64)[m]].sum()) for ids, m in zip(input_ids, masks_np))
        extra["coverage"] = inside / trained if trained else 1.0
    if "chat_template_sha256" not in extra:
        try:
            template = getattr(target.load_tokenizer(), "chat_template", None)
        except Exception:  # a test target without tokenizer files still gets a dataset
            template = None
        extra["chat_template_sha256"] = chat_template_sha256(template)
    fields = {
        "max_length": max(lengths) if lengths else 0,
        "counts": {"samples": len(input_ids), "tokens": int(sum(lengths)), "trained_tokens": trained},
        # same shape as prepare's sources: one entry per source name (the id before ':')
        "sources": [
            {"name": n} for n in sorted(set(s.split(":", 1)[0] if ":" in s else "samples" for s in source_ids))
        ],
        "draft_vocab_size": int(torch.as_tensor(d2t).shape[0]),
        "target_vocab_size": vocab_size,
    }
    fields.update(extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        shards = []
        for k, start in enumerate(range(0, max(len(input_ids), 1), shard_size)):
            sl = slice(start, start + shard_size)
            n = write_shard(tmp / shard_name(k), input_ids[sl], loss_masks[sl], source_ids[sl])
            shards.append({"file": shard_name(k), "rows": n})
        save_draft_vocab(tmp, d2t, t2d)
        finalize_manifest(tmp, target.identity, shards, fields)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# -------------------------------------------------------------------------------------- read


class PreparedDataset:
    """Random access over a prepared directory; all shards are memory-mapped Arrow buffers."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest
        ids_parts, mask_parts, src_parts, len_parts = [], [], [], []
        for s in manifest["shards"]:
            f = inside(self.path, s.get("file"), "prepared dataset")
            if not f.is_file():
                raise EyasError(
                    f"prepared dataset {self.path}: shard {s['file']} is missing; "
                    "re-run `eyas prepare` into a new directory"
                )
            table = pq.read_table(f, memory_map=True)
            if table.num_rows != s["rows"]:
                raise EyasError(
                    f"prepared dataset {self.path}: shard {s['file']} has "
                    f"{table.num_rows} rows, the manifest says {s['rows']}; it was "
                    "modified after prepare: re-run `eyas prepare`"
                )
            ids = table.column("input_ids").combine_chunks()
            mask = table.column("loss_mask").combine_chunks()
            offs = ids.offsets.to_numpy()
            len_parts.append(np.diff(offs))
            ids_parts.append(ids.values.to_numpy())
            mask_parts.append(mask.values.to_numpy())
            src_parts.extend(table.column("source_id").to_pylist())
        self.lengths = (np.concatenate(len_parts) if len_parts else np.zeros(0)).astype(np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self._ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
        self._mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.int8)
        self._sources = src_parts

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> PreparedSample:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        a, b = self._offsets[i], self._offsets[i + 1]
        return PreparedSample(
            index=int(i),
            input_ids=self._ids[a:b].astype(np.int64),
            loss_mask=self._mask[a:b].astype(bool),
            source_id=self._sources[i],
        )

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def draft_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        f = inside(self.path, self.manifest.get("draft_vocab_file", VOCAB_FILE), "prepared dataset")
        if not f.is_file():
            raise EyasError(f"prepared dataset {self.path}: {f.name} is missing; re-run `eyas prepare`")
        tensors = load_file(str(f))
        return tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)


def open_prepared(path: str | os.PathLike, target=None) -> PreparedDataset:
    """Open a prepared dataset; with ``target``, refuse one made for another model/tokenizer."""
    path = Path(path)
    if path.is_file():
        raise EyasError(
            f"prepared dataset {path} is a file; pass the folder `eyas prepare --out DIR` wrote. "
            f"Conversations ({path.suffix or 'this file'}) are the input of `eyas prepare --data "
            f"{path} --out DIR`"
        )
    if not path.is_dir():
        raise EyasError(f"prepared dataset {path}: no such directory; run `eyas prepare --out {path}` first")
    if not (path / MANIFEST).is_file():
        raise EyasError(
            f"prepared dataset {path}: no {MANIFEST}, so it is not a finished "
            "`eyas prepare` output (still running, or interrupted: re-run prepare to resume)"
        )
    manifest = read_manifest(path, what="prepared dataset")
    if manifest.get("kind") != KIND:
        raise EyasError(
            f"prepared dataset {path}: manifest kind is {manifest.get('kind')!r}, "
            f"expected {KIND!r}; pass the directory written by `eyas prepare`"
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EyasError(
            f"prepared dataset {path}: format_version {manifest.get('format_version')!r}, "
            f"this eyas reads {FORMAT_VERSION}; re-run `eyas prepare`"
        )
    if target is not None:
        found = manifest.get("target") or {}
        diffs = [
            f"target.{k}: {found.get(k)!r} in the dataset, {target.identity.get(k)!r} for {target.spec}"
            for k in IDENTITY_KEYS
            if found.get(k) != target.identity.get(k)
        ]
        if diffs:
            from eyas.target import identity_scheme_note

            raise EyasError(
                f"prepared dataset {path} was made for another target ("
                + "; ".join(diffs)
                + ")."
                + identity_scheme_note(found, target.identity)
                + " Re-run `eyas prepare` with this target into a new directory."
            )
    return PreparedDataset(path, manifest)
