"""Reading a hidden-state store: random access by sample, shard-order iteration, fp8 decoded.

Shards are mmapped lazily and each one's checksum is checked the first time this reader opens
it. ``reader[i]`` gives float states whatever the store's dtype (an fp8 store is dequantized
here, in fp32); :meth:`StoreReader.raw` gives the stored tensors and scales, for callers that
decode on the device (the trainer: half the bytes cross to the GPU).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.features.format import KIND, check_format, dequantize, layout_of, read_header, shard_file
from eyas.features.verify import scale_problem, shard_problem
from eyas.features.writer import tables
from eyas.fsio import inside
from eyas.manifest import MANIFEST, read_manifest


@dataclass
class StoredSample:
    index: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux: torch.Tensor  # [T, num_aux, H]: the store's dtype, fp32 for an fp8 store
    final: torch.Tensor  # [T, H]


@dataclass
class RawSample:
    """A sample as stored: ``hidden`` [T, A+1, H] in the store dtype, ``scale`` [T, A+1, G] fp32 for fp8."""

    index: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    scale: torch.Tensor | None


class StoreReader:
    """Random access by sample index and shard-order iteration; shards are mmapped lazily."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest
        self.layout = layout_of(manifest, f"store {self.path}")
        s = manifest["samples"]
        self.indices = np.asarray(s["index"], dtype=np.int64)
        self._shard = np.asarray(s["shard"], dtype=np.int64)
        self._offset = np.asarray(s["offset"], dtype=np.int64)
        self.lengths = np.asarray(s["length"], dtype=np.int64)
        self._pos = {int(i): p for p, i in enumerate(self.indices)}
        self.aux_layers = list(manifest["aux_layers"])
        self.final_layer = int(manifest["final_layer"])
        self._handles: dict[int, Any] = {}
        self._mu = threading.Lock()
        # each shard's checksum is checked the first time this reader opens it (once per process)
        self._records = {int(r["shard"]): r for r in manifest.get("shards", [])}
        for sid, r in self._records.items():  # every name up front: nothing outside the store is opened
            if inside(self.path, r.get("file"), "store").name != shard_file(sid):
                raise EyasError(
                    f"store {self.path}: its manifest names {r['file']!r} for shard {sid}, whose "
                    f"file is {shard_file(sid)}; the manifest was edited or damaged: re-run "
                    "`eyas extract` into a new --out"
                )

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def _open(self, sid: int):
        h = self._handles.get(sid)
        if h is None:
            from safetensors import safe_open

            f = self.path / shard_file(sid)
            if not f.is_file():
                raise EyasError(
                    f"store {self.path}: {f.name} is missing; run `eyas extract` again "
                    "with the same arguments to redo it, or --verify to list problems"
                )
            rec = self._records.get(sid)
            problem = shard_problem(self.path, rec) if rec is not None else None
            if not problem and self.layout.quantized:
                # scales are 1/H of the data: checking them costs nothing and stops a shard whose
                # scales are wrong however consistent its checksums are
                start, header = read_header(f)
                problem = (
                    scale_problem(f, header, start)
                    if "hidden_scale" in header
                    else "no hidden_scale tensor in an fp8 store"
                )
            if problem:
                prepared = self.manifest.get("prepared_path") or "PREPARED_DIR"
                raise EyasError(
                    f"store {self.path}: {f.name} is corrupt ({problem}); nothing was "
                    f"trained on it. Re-run `eyas extract --data {prepared} --out {self.path}` "
                    "with the --target and --layers the store was made with: it re-checks "
                    "every stored shard and extracts the bad ones again; then resume training "
                    f"with --resume (`eyas extract --verify {self.path}` lists every problem)"
                )
            h = safe_open(str(f), framework="pt")
            with self._mu:
                self._handles[sid] = h
        return h

    def _raw(self, pos: int) -> RawSample:
        sid, a = int(self._shard[pos]), int(self._offset[pos])
        b = a + int(self.lengths[pos])
        h = self._open(sid)
        scale = h.get_slice("hidden_scale")[a:b] if self.layout.quantized else None
        return RawSample(
            index=int(self.indices[pos]),
            input_ids=h.get_slice("input_ids")[a:b],
            loss_mask=h.get_slice("loss_mask")[a:b],
            hidden=h.get_slice("hidden")[a:b],
            scale=scale,
        )

    def _read(self, pos: int) -> StoredSample:
        r = self._raw(pos)
        hidden = r.hidden if r.scale is None else dequantize(r.hidden, r.scale)
        return StoredSample(
            index=r.index, input_ids=r.input_ids, loss_mask=r.loss_mask, aux=hidden[:, :-1], final=hidden[:, -1]
        )

    def _position(self, index: int) -> int:
        pos = self._pos.get(int(index))
        if pos is None:
            raise IndexError(f"sample {index} is not in store {self.path}")
        return pos

    def __getitem__(self, index: int) -> StoredSample:
        return self._read(self._position(index))

    def raw(self, index: int) -> RawSample:
        """Sample ``index`` as stored (fp8 values and their scales undecoded)."""
        return self._raw(self._position(index))

    def iter_shard_order(self) -> Iterator[StoredSample]:
        """All samples, shard by shard, each shard front to back (sequential reads)."""
        for pos in np.lexsort((self._offset, self._shard)):
            yield self._read(int(pos))


def committed_records(path: Path) -> dict[int, dict[str, Any]]:
    """The shard records whose shard file exists (what an interrupted run left committed)."""
    records = {}
    for p in Path(path).glob("shard-*.json"):
        if (Path(path) / shard_file(int(p.stem.split("-")[1]))).is_file():
            r = json.loads(p.read_text())
            records[int(r["shard"])] = r
    return records


def open_store(path: str | os.PathLike, allow_incomplete: bool = False) -> StoreReader:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise EyasError(f"store {path}: no {MANIFEST}; run `eyas extract --out {path}` first")
    manifest = read_manifest(path, what="store")
    if manifest.get("kind") != KIND:
        raise EyasError(f"store {path}: manifest kind is {manifest.get('kind')!r}, expected {KIND!r}")
    check_format(manifest, f"store {path}")
    if "samples" not in manifest or not (manifest.get("complete") or allow_incomplete):
        if not allow_incomplete:
            raise EyasError(
                f"store {path} is incomplete (the extract run was interrupted); re-run "
                "`eyas extract` with the same arguments to finish it"
            )
        manifest = {**manifest, **tables(committed_records(path))}
    return StoreReader(path, manifest)
