"""Writing a hidden-state store: shards on background threads, committed atomically, resumable.

A shard is written under a temporary name and renamed; its record is written (atomically) after
that rename, so a shard counts as stored only once both exist. A crash at any moment leaves
either a committed shard or debris that the next writer deletes, never a half shard that
looks whole. Shards are written by hand in the safetensors format straight from the caller's
(pinned) buffer, one ``write`` per sample row, hashing as it goes: no intermediate copies.
The layout itself (tensor order, dtypes, fp8 scales) is :mod:`eyas.features.format`.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.features.format import (
    CHECKED_FIELDS,
    FP8,
    KIND,
    SHARD_RE,
    Layout,
    check_format,
    new_hasher,
    quantize,
    raw_bytes,
    record_file,
    shard_file,
)
from eyas.features.verify import shard_problem
from eyas.manifest import MANIFEST, read_manifest, write_manifest


@dataclass
class ShardItem:
    """One sample of a shard: ``states`` is a contiguous CPU tensor [T, A+1, H] in the store's
    state dtype; for an fp8 store ``scale`` holds its fp32 scales [T, A+1, G]."""

    index: int
    input_ids: np.ndarray | torch.Tensor
    loss_mask: np.ndarray | torch.Tensor
    states: torch.Tensor
    scale: torch.Tensor | None = None


def _check_item(it: ShardItem, layout: Layout) -> None:
    s, want = it.states, (layout.num_slots, layout.hidden)
    if (
        s.dtype != layout.state_dtype
        or s.dim() != 3
        or tuple(s.shape[1:]) != want
        or not s.is_contiguous()
        or s.device.type != "cpu"
    ):
        raise EyasError(
            f"sample {it.index}: states {tuple(s.shape)} {s.dtype} on {s.device}; the "
            f"store expects contiguous CPU [T,{want[0]},{want[1]}] {layout.state_dtype}"
        )
    if layout.quantized:
        c = it.scale
        shape = (s.shape[0], layout.num_slots, layout.scale_groups)
        if (
            c is None
            or c.dtype != torch.float32
            or tuple(c.shape) != shape
            or not c.is_contiguous()
            or c.device.type != "cpu"
        ):
            got = "none" if c is None else f"{tuple(c.shape)} {c.dtype} on {c.device}"
            raise EyasError(
                f"sample {it.index}: fp8 scales {got}; the store expects contiguous CPU {list(shape)} float32"
            )


def write_shard_file(path: Path, items: Sequence[ShardItem], layout: Layout) -> tuple[str, str, int, dict[str, str]]:
    """Write one shard in the safetensors format.

    Returns (checksum algo, digest of the file, bytes, digest of each tensor's bytes); the
    per-tensor digests let ``--verify`` name the tensor that changed (e.g. fp8 scales).
    """
    for it in items:
        _check_item(it, layout)
    n = sum(int(it.states.shape[0]) for it in items)
    hbytes = layout.header(n)
    algo, h = new_hasher()
    tensor_digests: dict[str, str] = {}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb", buffering=0) as fh:

            def put(bufs) -> None:
                for buf in bufs:
                    h.update(buf)
                    th.update(buf)
                    view = memoryview(buf)
                    while view:
                        view = view[fh.write(view) :]

            th = new_hasher()[1]  # the header belongs to the file checksum only
            put([len(hbytes).to_bytes(8, "little") + hbytes])
            parts = {
                "input_ids": lambda: [
                    np.concatenate([np.asarray(it.input_ids, dtype=np.int64) for it in items]).tobytes()
                ],
                "hidden_scale": lambda: [raw_bytes(it.scale) for it in items],
                "hidden": lambda: [raw_bytes(it.states) for it in items],
                "loss_mask": lambda: [
                    np.concatenate([np.asarray(it.loss_mask, dtype=np.bool_) for it in items]).tobytes()
                ],
            }
            for name, *_ in layout.tensors(n):
                th = new_hasher()[1]
                put(parts[name]())
                tensor_digests[name] = th.hexdigest()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return algo, h.hexdigest(), layout.shard_bytes(n), tensor_digests


def manifest_diffs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The fields in which a store on disk differs from the settings of a run that would resume it."""
    return [
        f"{k}: {old.get(k)!r} in the store, {new.get(k)!r} now"
        for k in (*CHECKED_FIELDS, "kind", "format_version")
        if old.get(k) != new.get(k)
    ]


def check_resumable(path: str | os.PathLike, manifest_fields: dict[str, Any]) -> None:
    """Refuse, naming the fields, when a store at ``path`` was made with other settings than
    ``manifest_fields`` (nothing is created or locked: the plan calls this before any work)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return
    fields, _ = store_fields(manifest_fields, str(path))
    old = read_manifest(path, what="store")
    check_format(old, f"store {path}")
    diffs = manifest_diffs(old, fields)
    if diffs:
        raise EyasError(
            f"store {path} was made with other settings ("
            + "; ".join(diffs)
            + "). Re-run with the same settings to resume, or pass a new --out."
        )


def store_fields(manifest_fields: dict[str, Any], where: str) -> tuple[dict[str, Any], Layout]:
    """Complete a run's manifest fields with the store layout (dtype, scale, format version).

    ``manifest_fields`` may hold ``scale_groups`` (fp8: scales per token and state, default 1);
    it is replaced by the ``scale`` record.
    """
    fields = dict(manifest_fields)
    missing = [
        k
        for k in ("target", "aux_layers", "final_layer", "convention", "dtype", "hidden_size", "num_samples")
        if k not in fields
    ]
    if missing:
        raise EyasError(f"StoreWriter {where}: manifest_fields lacks {missing}")
    fields["aux_layers"] = [int(k) for k in fields["aux_layers"]]
    groups = fields.pop("scale_groups", None)
    if groups is None:
        groups = 1 if fields["dtype"] == FP8 else 0
    layout = Layout(fields["dtype"], len(fields["aux_layers"]) + 1, int(fields["hidden_size"]), int(groups))
    fields.update(kind=KIND, **layout.manifest_fields())
    return fields, layout


class StoreWriter:
    """Create or resume a store; shards are written on ``num_writers`` background threads.

    ``manifest_fields`` must hold ``target`` (identity dict), ``aux_layers``, ``final_layer``,
    ``convention``, ``dtype`` ("bf16"/"fp16"/"fp32"/"fp8"), ``hidden_size`` and ``num_samples``
    (for fp8 optionally ``scale_groups``); a store on disk whose fields differ is refused (naming
    the field), never mixed. ``done`` holds the sample indices already stored (committed shards),
    for resume.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        manifest_fields: dict[str, Any],
        shard_tokens: int = 1 << 16,
        num_writers: int = 4,
        max_pending: int | None = None,
    ):
        self.path = Path(path)
        fields, self.layout = store_fields(manifest_fields, str(self.path))
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.path / ".lock", "w")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._lock_fh.close()
            raise EyasError(
                f"store {self.path} is being written by another process; wait for it or pass another --out"
            ) from e
        self.num_slots = self.layout.num_slots
        self.hidden_size = self.layout.hidden
        try:
            check_resumable(self.path, manifest_fields)
        except EyasError:
            self._lock_fh.close()
            raise
        fields["complete"] = False
        for k in ("samples", "shards"):
            fields.pop(k, None)
        self.fields = fields
        self.records: dict[int, dict[str, Any]] = {}
        self.rewritten: list[str] = []  # committed shards found corrupt and dropped, to be redone
        self._clean_and_load()
        write_manifest(self.path, self.fields)
        self.done: set[int] = {i for r in self.records.values() for i in r["samples"]["index"]}
        self.shard_tokens = shard_tokens
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_writers), thread_name_prefix="eyas-w")
        self._sem = threading.BoundedSemaphore(max_pending or 2 * max(1, num_writers))
        self._futures: list[Future] = []
        self._mu = threading.Lock()
        self._buf: list[ShardItem] = []
        self._buf_tokens = 0
        self._next_id = max(self.records, default=-1) + 1
        self._reserved: set[int] = set()
        self._queued: set[int] = set()
        self.on_commit: Callable[[dict[str, Any]], None] | None = None  # e.g. a progress bar
        self.bytes_written = 0
        self.tokens_written = 0

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored ``hidden`` tensor (float8_e4m3fn for an fp8 store)."""
        return self.layout.state_dtype

    def _clean_and_load(self) -> None:
        """Load committed shard records; delete temp files and shards without a record, and re-check
        every committed shard's checksum: a corrupt one is deleted with its record (``rewritten``)."""
        for p in self.path.iterdir():
            if p.name.startswith(".shard-") or p.name.startswith(f".{MANIFEST}.tmp"):
                p.unlink()  # debris of a write that never finished
        for p in sorted(self.path.iterdir()):
            m = SHARD_RE.match(p.name)
            if not m:
                continue
            sid = int(m.group(1))
            rec = self.path / record_file(sid)
            if not rec.is_file():
                p.unlink()  # renamed but never recorded: its contents were never counted
                continue
            record = json.loads(rec.read_text())
            problem = shard_problem(self.path, record)
            if problem:  # corrupt since it was written: drop it, its samples are extracted again
                p.unlink()
                rec.unlink()
                self.rewritten.append(f"{p.name} ({problem}): {len(record['samples']['index'])} samples")
                continue
            self.records[sid] = record
        for p in self.path.glob("shard-*.json"):
            sid = int(p.stem.split("-")[1])
            if sid not in self.records:
                p.unlink()

    # -------------------------------------------------------------------------- add API

    def to_item(self, index: int, input_ids, loss_mask, states: torch.Tensor) -> ShardItem:
        """One sample's [T, A+1, H] states (any device or float dtype) as a checked shard item in the
        store's layout; fp8 is quantized where ``states`` lie (on a GPU: before the copy, which
        then moves half the bytes)."""
        if self.layout.quantized:
            q, scale = quantize(states, self.layout.scale_groups)
            states, scale = q.cpu().contiguous(), scale.cpu().contiguous()
            check_finite(scale, index)  # a NaN/Inf state makes its group's scale non-finite
        else:
            states, scale = states.to("cpu", self.dtype).contiguous(), None
            check_finite(states, index)
        ids = torch.as_tensor(input_ids).cpu().numpy().astype(np.int64)
        mask = torch.as_tensor(loss_mask).cpu().numpy().astype(np.bool_)
        if not len(ids) == len(mask) == states.shape[0]:
            raise EyasError(
                f"sample {index}: {len(ids)} input_ids, {len(mask)} loss_mask entries and "
                f"{states.shape[0]} state rows; they must be equal"
            )
        return ShardItem(index, ids, mask, states, scale)

    def add(self, index: int, input_ids, loss_mask, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Add one sample (any device/dtype); shards are cut every ``shard_tokens`` tokens."""
        self._raise_failed()
        if index in self.done or index in self._queued:
            raise EyasError(f"sample {index} is already in store {self.path}; skip indices in `.done`")
        self._queued.add(index)
        aux, final = aux.detach(), final.detach()
        if (
            aux.dim() != 3
            or final.dim() != 2
            or aux.shape[0] != final.shape[0]
            or aux.shape[1:] != (self.num_slots - 1, self.hidden_size)
        ):
            raise EyasError(
                f"sample {index}: aux {tuple(aux.shape)} / final {tuple(final.shape)}, "
                f"expected [T,{self.num_slots - 1},{self.hidden_size}] / [T,{self.hidden_size}]"
            )
        item = self.to_item(index, input_ids, loss_mask, torch.cat([aux, final[:, None]], dim=1))
        self._buf.append(item)
        self._buf_tokens += item.states.shape[0]
        if self._buf_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            items, self._buf, self._buf_tokens = self._buf, [], 0
            self.submit_shard(items)

    def submit_shard(
        self,
        items: Sequence[ShardItem],
        shard_id: int | None = None,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> Future:
        """Write ``items`` as one shard on a writer thread.

        ``before`` runs on the writer thread first (e.g. wait for a CUDA event, check NaNs);
        ``after`` runs when the shard is done or failed (e.g. give a pinned buffer back). Blocks
        while too many shards are pending, so memory stays bounded.
        """
        self._raise_failed()
        with self._mu:
            if shard_id is None:
                while self._next_id in self.records or self._next_id in self._reserved:
                    self._next_id += 1
                shard_id = self._next_id
            elif shard_id in self.records or shard_id in self._reserved:
                raise EyasError(f"store {self.path}: shard {shard_id} already exists")
            self._reserved.add(shard_id)
        self._sem.acquire()
        fut = self._pool.submit(self._write, shard_id, list(items), before, after)
        self._futures.append(fut)
        return fut

    def _write(self, shard_id: int, items: list[ShardItem], before, after) -> None:
        try:
            if before is not None:
                before()
            dup = [it.index for it in items if it.index in self.done]
            if dup:
                raise EyasError(f"samples {dup[:5]} are already stored in {self.path}")
            path = self.path / shard_file(shard_id)
            algo, digest, nbytes, tensors = write_shard_file(path, items, self.layout)
            lengths = [int(it.states.shape[0]) for it in items]
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
            record = {
                "shard": shard_id,
                "file": path.name,
                "tokens": int(sum(lengths)),
                "bytes": nbytes,
                "checksum": {"algo": algo, "digest": digest},
                "tensor_checksums": tensors,
                "samples": {"index": [int(it.index) for it in items], "offset": offsets, "length": lengths},
            }
            write_manifest(self.path, record, name=record_file(shard_id))  # the commit point
            with self._mu:
                self.records[shard_id] = record
                self.done.update(record["samples"]["index"])
                self.bytes_written += nbytes
                self.tokens_written += record["tokens"]
            if self.on_commit is not None:
                self.on_commit(record)
        finally:
            with self._mu:
                self._reserved.discard(shard_id)
            self._sem.release()
            if after is not None:
                after()

    def _raise_failed(self) -> None:
        still = []
        for f in self._futures:
            if f.done():
                f.result()  # re-raises a writer thread's error here, in the caller's thread
            else:
                still.append(f)
        self._futures = still

    def wait(self) -> None:
        """Block until every submitted shard is on disk (re-raising any writer error)."""
        for f in list(self._futures):
            f.result()
        self._futures = []

    def close(self) -> dict[str, Any]:
        """Flush, wait, and write the manifest (``complete`` once every sample is stored)."""
        try:
            self.flush()
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
        manifest = dict(self.fields)
        manifest["complete"] = len(self.done) == int(self.fields["num_samples"]) and self.done == set(
            range(int(self.fields["num_samples"]))
        )
        manifest.update(tables(self.records))
        write_manifest(self.path, manifest)
        self._lock_fh.close()
        return manifest

    def abort(self) -> None:
        """Stop without finishing pending shards (their debris is cleaned on the next open)."""
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._lock_fh.close()


# exponent bits all ones = Inf or NaN, for the 16-bit float formats numpy cannot represent
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def check_finite(states: torch.Tensor, index: int) -> None:
    """Raise naming ``index`` if a [T, slots, ...] CPU tensor (states, or an fp8 store's scales)
    holds NaN/Inf.

    Pure numpy on purpose: writer threads call it, and torch ops there would start a second
    OpenMP team next to the forward pass (on a small CPU that stalled extraction ~6x).
    """
    if states.dtype in _EXP_MASK:
        m = _EXP_MASK[states.dtype]
        bad = (states.view(torch.int16).numpy() & m) == m
    else:
        bad = ~np.isfinite(states.numpy())
    if bad.any():
        tok, slot = np.argwhere(bad.reshape(bad.shape[0], bad.shape[1], -1).any(axis=2))[0].tolist()
        raise EyasError(
            f"sample {index}: the target produced NaN/Inf hidden states (first at token "
            f"{tok}, slot {slot}); the run stopped. Check the target's dtype "
            "(try --model-dtype fp32 or a bf16-safe model) and this sample's tokens"
        )


def tables(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's sample and shard tables from the committed shard records."""
    rows = sorted(
        (i, sid, o, n)
        for sid, r in records.items()
        for i, o, n in zip(r["samples"]["index"], r["samples"]["offset"], r["samples"]["length"])
    )
    return {
        "samples": {
            "index": [r[0] for r in rows],
            "shard": [r[1] for r in rows],
            "offset": [r[2] for r in rows],
            "length": [r[3] for r in rows],
        },
        "shards": [
            {k: r[k] for k in ("shard", "file", "tokens", "bytes", "checksum", "tensor_checksums")}
            for _, r in sorted(records.items())
        ],
        "tokens": int(sum(r["tokens"] for r in records.values())),
        "bytes": int(sum(r["bytes"] for r in records.values())),
    }
