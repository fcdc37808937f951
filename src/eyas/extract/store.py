"""The hidden-state store (interface B): sharded safetensors + a manifest, resumable, verifiable.

Layout of a store directory::

    manifest.json                 kind "eyas-store", target identity, layer ids, convention,
                                  dtype, hidden size, prepared-dataset id; on completion also
                                  the sample table (index -> shard, offset, length) and shards
    shard-000007.safetensors      input_ids int64 [N], hidden <dtype> [N, A+1, H], loss_mask
                                  bool [N]: the samples of one shard concatenated along tokens
                                  (slot A of ``hidden`` is the final state)
    shard-000007.json             the shard's commit record: samples, tokens, bytes, checksum

A shard is written under a temporary name and renamed; its record is written (atomically) after
that rename, so a shard counts as stored only once both exist. A crash at any moment leaves
either a committed shard or debris that the next writer deletes, never a half shard that
looks whole. Shards are written by hand in the safetensors format straight from the caller's
(pinned) buffer, one ``write`` per sample row, hashing as it goes: no intermediate copies.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, read_manifest, write_manifest

KIND = "eyas-store"
FORMAT_VERSION = 1
_SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")

# Fields that must agree between a store being resumed and the run resuming it.
CHECKED_FIELDS = ("target", "aux_layers", "final_layer", "convention", "dtype", "hidden_size",
                  "prepared_id", "num_samples", "backend", "plan")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
             torch.int64: "I64", torch.bool: "BOOL"}
_RAW_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
             torch.int64: torch.int64, torch.bool: torch.uint8}


def shard_file(shard_id: int) -> str:
    return f"shard-{shard_id:06d}.safetensors"


def record_file(shard_id: int) -> str:
    return f"shard-{shard_id:06d}.json"


# ------------------------------------------------------------------------------- checksums


def _hasher():
    """xxh3-64 (GB/s) when the xxhash package is present, else sha256; the name is recorded."""
    try:
        import xxhash

        return "xxh3_64", xxhash.xxh3_64()
    except ImportError:  # pragma: no cover - depends on the machine
        return "sha256", hashlib.sha256()


def _hasher_for(name: str):
    if name == "sha256":
        return hashlib.sha256()
    if name == "xxh3_64":
        try:
            import xxhash
        except ImportError as e:
            raise EyasError("this store's checksums are xxh3_64: install the 'xxhash' package "
                            "to verify it (pip install xxhash)") from e
        return xxhash.xxh3_64()
    raise EyasError(f"unknown checksum algorithm {name!r} in the store; was it written by a newer eyas?")


def file_checksum(path: Path, algo: str) -> str:
    h = _hasher_for(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_problem(path: Path, record: dict[str, Any]) -> str | None:
    """What is wrong with the shard file ``record`` describes (missing, size, checksum), or None.
    Reads the whole file once (xxh3: GB/s)."""
    f = Path(path) / record["file"]
    if not f.is_file():
        return "missing"
    size = f.stat().st_size
    if size != record["bytes"]:
        return f"{size} bytes, its record says {record['bytes']}"
    digest = file_checksum(f, record["checksum"]["algo"])
    if digest != record["checksum"]["digest"]:
        return f"checksum {digest}, its record says {record['checksum']['digest']}"
    return None


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor without copying (bf16 has no numpy dtype: view as int16)."""
    t = t.view(_RAW_VIEW[t.dtype]) if t.dtype in _RAW_VIEW else t
    return memoryview(t.numpy()).cast("B")


# ------------------------------------------------------------------------------- writing


@dataclass
class ShardItem:
    """One sample of a shard: ``states`` is a contiguous CPU tensor [T, A+1, H] in the store dtype."""

    index: int
    input_ids: np.ndarray | torch.Tensor
    loss_mask: np.ndarray | torch.Tensor
    states: torch.Tensor


def write_shard_file(path: Path, items: Sequence[ShardItem], num_slots: int, hidden: int,
                     dtype: torch.dtype) -> tuple[str, str, int]:
    """Write one shard in the safetensors format; returns (checksum algo, digest, bytes)."""
    n = sum(int(it.states.shape[0]) for it in items)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {"input_ids": n * 8, "hidden": n * num_slots * hidden * itemsize, "loss_mask": n}
    shapes = {"input_ids": [n], "hidden": [n, num_slots, hidden], "loss_mask": [n]}
    dts = {"input_ids": "I64", "hidden": _ST_DTYPE[dtype], "loss_mask": "BOOL"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "eyas": "hidden-state-shard"}}
    off = 0
    for name in ("input_ids", "hidden", "loss_mask"):  # int64 first keeps every tensor aligned
        header[name] = {"dtype": dts[name], "shape": shapes[name], "data_offsets": [off, off + sizes[name]]}
        off += sizes[name]
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    algo, h = _hasher()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb", buffering=0) as fh:
            def put(buf) -> None:
                h.update(buf)
                view = memoryview(buf)
                while view:
                    view = view[fh.write(view):]
            put(len(hbytes).to_bytes(8, "little") + hbytes)
            put(np.concatenate([np.asarray(it.input_ids, dtype=np.int64) for it in items]).tobytes())
            for it in items:
                s = it.states
                if s.dtype != dtype or s.dim() != 3 or s.shape[1:] != (num_slots, hidden) \
                        or not s.is_contiguous() or s.device.type != "cpu":
                    raise EyasError(f"sample {it.index}: states {tuple(s.shape)} {s.dtype} on "
                                    f"{s.device}; the store expects contiguous CPU [T,{num_slots},"
                                    f"{hidden}] {dtype}")
                put(_raw(s))
            put(np.concatenate([np.asarray(it.loss_mask, dtype=np.bool_) for it in items]).tobytes())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return algo, h.hexdigest(), 8 + len(hbytes) + off


class StoreWriter:
    """Create or resume a store; shards are written on ``num_writers`` background threads.

    ``manifest_fields`` must hold ``target`` (identity dict), ``aux_layers``, ``final_layer``,
    ``convention``, ``dtype`` ("bf16"/"fp16"/"fp32"), ``hidden_size`` and ``num_samples``; a
    store on disk whose fields differ is refused (naming the field), never mixed.
    ``done`` holds the sample indices already stored (committed shards), for resume.
    """

    def __init__(self, path: str | os.PathLike, manifest_fields: dict[str, Any],
                 shard_tokens: int = 1 << 16, num_writers: int = 4, max_pending: int | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.path / ".lock", "w")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._lock_fh.close()
            raise EyasError(f"store {self.path} is being written by another process; wait for it "
                            "or pass another --out") from e
        fields = dict(manifest_fields)
        missing = [k for k in ("target", "aux_layers", "final_layer", "convention", "dtype",
                               "hidden_size", "num_samples") if k not in fields]
        if missing:
            raise EyasError(f"StoreWriter {self.path}: manifest_fields lacks {missing}")
        if fields["dtype"] not in DTYPES:
            raise EyasError(f"store dtype {fields['dtype']!r}: use one of {sorted(DTYPES)}")
        fields.update(kind=KIND, format_version=FORMAT_VERSION)
        fields["aux_layers"] = [int(k) for k in fields["aux_layers"]]
        self.dtype = DTYPES[fields["dtype"]]
        self.num_slots = len(fields["aux_layers"]) + 1
        self.hidden_size = int(fields["hidden_size"])
        if (self.path / MANIFEST).is_file():
            old = read_manifest(self.path, what="store")
            diffs = [f"{k}: {old.get(k)!r} in the store, {fields.get(k)!r} now"
                     for k in (*CHECKED_FIELDS, "kind", "format_version") if old.get(k) != fields.get(k)]
            if diffs:
                raise EyasError(f"store {self.path} was made with other settings (" + "; ".join(diffs)
                                + "). Re-run with the same settings to resume, or pass a new --out.")
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

    def _clean_and_load(self) -> None:
        """Load committed shard records; delete temp files and shards without a record, and re-check
        every committed shard's checksum: a corrupt one is deleted with its record (``rewritten``)."""
        for p in self.path.iterdir():
            if p.name.startswith(".shard-") or p.name.startswith(f".{MANIFEST}.tmp"):
                p.unlink()  # debris of a write that never finished
        for p in sorted(self.path.iterdir()):
            m = _SHARD_RE.match(p.name)
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

    def add(self, index: int, input_ids, loss_mask, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Add one sample (any device/dtype); shards are cut every ``shard_tokens`` tokens."""
        self._raise_failed()
        if index in self.done or index in self._queued:
            raise EyasError(f"sample {index} is already in store {self.path}; skip indices in `.done`")
        self._queued.add(index)
        aux, final = aux.detach(), final.detach()
        if aux.dim() != 3 or final.dim() != 2 or aux.shape[0] != final.shape[0] \
                or aux.shape[1:] != (self.num_slots - 1, self.hidden_size):
            raise EyasError(f"sample {index}: aux {tuple(aux.shape)} / final {tuple(final.shape)}, "
                            f"expected [T,{self.num_slots - 1},{self.hidden_size}] / [T,{self.hidden_size}]")
        states = torch.cat([aux, final[:, None]], dim=1).to("cpu", self.dtype).contiguous()
        check_finite(states, index)
        ids = torch.as_tensor(input_ids).cpu().numpy().astype(np.int64)
        mask = torch.as_tensor(loss_mask).cpu().numpy().astype(np.bool_)
        if not len(ids) == len(mask) == states.shape[0]:
            raise EyasError(f"sample {index}: {len(ids)} input_ids, {len(mask)} loss_mask entries and "
                            f"{states.shape[0]} state rows; they must be equal")
        self._buf.append(ShardItem(index, ids, mask, states))
        self._buf_tokens += states.shape[0]
        if self._buf_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            items, self._buf, self._buf_tokens = self._buf, [], 0
            self.submit_shard(items)

    def submit_shard(self, items: Sequence[ShardItem], shard_id: int | None = None,
                     before: Callable[[], None] | None = None,
                     after: Callable[[], None] | None = None) -> Future:
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
            algo, digest, nbytes = write_shard_file(path, items, self.num_slots, self.hidden_size,
                                                    self.dtype)
            lengths = [int(it.states.shape[0]) for it in items]
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
            record = {"shard": shard_id, "file": path.name, "tokens": int(sum(lengths)),
                      "bytes": nbytes, "checksum": {"algo": algo, "digest": digest},
                      "samples": {"index": [int(it.index) for it in items], "offset": offsets,
                                  "length": lengths}}
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
        manifest["complete"] = len(self.done) == int(self.fields["num_samples"]) and \
            self.done == set(range(int(self.fields["num_samples"])))
        manifest.update(_tables(self.records))
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
    """Raise naming ``index`` if a [T, slots, H] CPU tensor holds NaN/Inf.

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
        raise EyasError(f"sample {index}: the target produced NaN/Inf hidden states (first at token "
                        f"{tok}, slot {slot}); the run stopped. Check the target's dtype "
                        "(try --dtype fp32 or a bf16-safe model) and this sample's tokens")


def _tables(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    rows = sorted((i, sid, o, n) for sid, r in records.items()
                  for i, o, n in zip(r["samples"]["index"], r["samples"]["offset"], r["samples"]["length"]))
    return {
        "samples": {"index": [r[0] for r in rows], "shard": [r[1] for r in rows],
                    "offset": [r[2] for r in rows], "length": [r[3] for r in rows]},
        "shards": [{k: r[k] for k in ("shard", "file", "tokens", "bytes", "checksum")}
                   for _, r in sorted(records.items())],
        "tokens": int(sum(r["tokens"] for r in records.values())),
        "bytes": int(sum(r["bytes"] for r in records.values())),
    }


# ------------------------------------------------------------------------------- reading


@dataclass
class StoredSample:
    index: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux: torch.Tensor        # [T, num_aux, H]
    final: torch.Tensor      # [T, H]


class StoreReader:
    """Random access by sample index and shard-order iteration; shards are mmapped lazily."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest
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

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def _open(self, sid: int):
        h = self._handles.get(sid)
        if h is None:
            from safetensors import safe_open

            f = self.path / shard_file(sid)
            if not f.is_file():
                raise EyasError(f"store {self.path}: {f.name} is missing; run `eyas extract` again "
                                "with the same arguments to redo it, or --verify to list problems")
            rec = self._records.get(sid)
            problem = shard_problem(self.path, rec) if rec is not None else None
            if problem:
                prepared = self.manifest.get("prepared_path") or "PREPARED_DIR"
                raise EyasError(f"store {self.path}: {f.name} is corrupt ({problem}); nothing was "
                                f"trained on it. Re-run `eyas extract --data {prepared} --out {self.path}` "
                                "with the --target and --layers the store was made with: it re-checks "
                                "every stored shard and extracts the bad ones again; then resume training "
                                f"with --resume (`eyas extract --verify {self.path}` lists every problem)")
            h = safe_open(str(f), framework="pt")
            with self._mu:
                self._handles[sid] = h
        return h

    def _read(self, pos: int) -> StoredSample:
        sid, a = int(self._shard[pos]), int(self._offset[pos])
        b = a + int(self.lengths[pos])
        h = self._open(sid)
        hidden = h.get_slice("hidden")[a:b]
        return StoredSample(index=int(self.indices[pos]),
                            input_ids=h.get_slice("input_ids")[a:b],
                            loss_mask=h.get_slice("loss_mask")[a:b],
                            aux=hidden[:, :-1], final=hidden[:, -1])

    def __getitem__(self, index: int) -> StoredSample:
        pos = self._pos.get(int(index))
        if pos is None:
            raise IndexError(f"sample {index} is not in store {self.path}")
        return self._read(pos)

    def iter_shard_order(self) -> Iterator[StoredSample]:
        """All samples, shard by shard, each shard front to back (sequential reads)."""
        for pos in np.lexsort((self._offset, self._shard)):
            yield self._read(int(pos))


def open_store(path: str | os.PathLike, allow_incomplete: bool = False) -> StoreReader:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise EyasError(f"store {path}: no {MANIFEST}; run `eyas extract --out {path}` first")
    manifest = read_manifest(path, what="store")
    if manifest.get("kind") != KIND:
        raise EyasError(f"store {path}: manifest kind is {manifest.get('kind')!r}, expected {KIND!r}")
    if "samples" not in manifest or not (manifest.get("complete") or allow_incomplete):
        if not allow_incomplete:
            raise EyasError(f"store {path} is incomplete (the extract run was interrupted); re-run "
                            "`eyas extract` with the same arguments to finish it")
        records = {}
        for p in path.glob("shard-*.json"):
            if (path / shard_file(int(p.stem.split("-")[1]))).is_file():
                r = json.loads(p.read_text())
                records[int(r["shard"])] = r
        manifest = {**manifest, **_tables(records)}
    return StoreReader(path, manifest)


# ------------------------------------------------------------------------------- verifying


def verify_store(path: str | os.PathLike, progress: bool = False) -> list[str]:
    """Re-check every shard's checksum, header shapes/dtypes and the sample table; list problems."""
    path = Path(path)
    problems: list[str] = []
    try:
        manifest = read_manifest(path, what="store")
    except EyasError as e:
        return [str(e)]
    if manifest.get("kind") != KIND:
        return [f"{path}/{MANIFEST}: kind {manifest.get('kind')!r}, expected {KIND!r}"]
    if not manifest.get("complete"):
        problems.append(f"{path}: the manifest is not marked complete (interrupted run); re-run "
                        "`eyas extract` with the same arguments")
    if "samples" not in manifest:
        return problems
    n_slots = len(manifest["aux_layers"]) + 1
    hidden = int(manifest["hidden_size"])
    st_dtype = _ST_DTYPE[DTYPES[manifest["dtype"]]]
    idx = manifest["samples"]["index"]
    n = int(manifest.get("num_samples", len(idx)))
    if sorted(idx) != list(range(n)):
        seen = set(idx)
        dup = len(idx) - len(seen)
        missing = [i for i in range(n) if i not in seen][:10]
        problems.append(f"sample table: {dup} duplicated, missing {missing} (of {n})")
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for sid, off, ln in zip(manifest["samples"]["shard"], manifest["samples"]["offset"],
                            manifest["samples"]["length"]):
        by_shard.setdefault(int(sid), []).append((int(off), int(ln)))
    shards = manifest.get("shards", [])
    it = shards
    if progress:
        from tqdm import tqdm

        it = tqdm(shards, desc="verify", unit="shard")
    for s in it:
        f = path / s["file"]
        if not f.is_file():
            problems.append(f"{s['file']}: missing")
            continue
        if f.stat().st_size != s["bytes"]:
            problems.append(f"{s['file']}: {f.stat().st_size} bytes, the manifest says {s['bytes']}")
            continue
        digest = file_checksum(f, s["checksum"]["algo"])
        if digest != s["checksum"]["digest"]:
            problems.append(f"{s['file']}: checksum {digest} != {s['checksum']['digest']} (corrupted)")
            continue
        try:
            with open(f, "rb") as fh:
                hl = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(hl))
        except (ValueError, OSError) as e:
            problems.append(f"{s['file']}: unreadable safetensors header ({e})")
            continue
        ntok = s["tokens"]
        want = {"input_ids": ("I64", [ntok]), "hidden": (st_dtype, [ntok, n_slots, hidden]),
                "loss_mask": ("BOOL", [ntok])}
        for name, (dt, shape) in want.items():
            got = header.get(name)
            if got is None or got["dtype"] != dt or got["shape"] != shape:
                problems.append(f"{s['file']}: tensor {name} is "
                                f"{(got or {}).get('dtype')} {(got or {}).get('shape')}, expected {dt} {shape}")
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
