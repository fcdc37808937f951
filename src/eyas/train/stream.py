"""`eyas train --features vllm`: features made by a vLLM engine while the draft trains, through a
bounded buffer directory instead of a full store.

The trainer hands :meth:`StreamFeatures.start` its calls in order (``Trainer.planned_calls``: each
micro-batch of each step on this rank, and the held-out batches of each planned evaluation), the
same pack order offline training reads a store in. Engines (``eyas_vllm_worker.stream`` in the vLLM
interpreter; :mod:`eyas.train.stream_feed` feeds them) make one chunk file per call in the buffer,
and :meth:`StreamFeatures.batch` reads it, checks every sample's tokens against the prepared
dataset, builds the same :class:`~eyas.train.features.Batch` as the other sources and deletes the
file. The buffer holds at most ``--feature-buffer-gb`` (split over the ranks: each rank has its
own engine(s) and its own part of the buffer).

Later epochs re-extract by default. With ``--feature-cache-gb G`` a sample's states are also kept in
``OUT/feature-cache`` (up to G GB, first come) and not asked of the engine again (hybrid).
A killed run resumes at its checkpoint: chunks it had made ahead are used (their names say which
call they serve, their tokens are checked), the cache is kept.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eyas.errors import EyasError
from eyas.features.layers import resolve_layers
from eyas.train.features import Batch, _samples, _to, pinned
from eyas.train.packing import layout
from eyas.train.stream_feed import Feeder, Unit, unit_bytes
from eyas.vllm.worker.chunks import PREFIX, list_chunks, read_chunk

GB = 1e9  # --feature-buffer-gb and --feature-cache-gb are decimal gigabytes
REPORT_FILE = "features.json"


def unit_name(step: int, kind: int, k: int) -> str:
    """A call's name, sorting in plan order: micro-batch ``k`` of step ``step`` (kind 0), or held-out
    batch ``k`` of the evaluation after that step (kind 1)."""
    return f"{step:09d}-{kind}-{k:04d}"


def default_buffer_dir(out: str | Path, limit_bytes: int) -> Path:
    """Under /dev/shm (memory, no disk wear) when it exists and has room for the limit, else OUT/feature-buffer."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        try:
            free = shutil.disk_usage(shm).free
        except OSError:
            free = 0
        if free >= limit_bytes:
            key = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]
            return shm / f"eyas-stream-{key}"
    return Path(out) / "feature-buffer"


class FeatureCache:
    """Samples' states kept on disk for later epochs, up to ``limit`` bytes (first come, never evicted)."""

    def __init__(self, path: Path, limit: int, key: dict[str, Any]):
        self.path, self.limit, self.lock = path, limit, threading.Lock()
        marker = path / "cache.json"
        if marker.is_file() and json.loads(marker.read_text()) != key:
            shutil.rmtree(path)  # made for another target, layer set or dtype: of no use here
        path.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(key))
        self.files = {int(p.stem): p for p in path.glob("*.safetensors") if p.stem.isdigit()}
        for tmp in path.glob("*.tmp"):
            tmp.unlink()
        self.bytes = sum(p.stat().st_size for p in self.files.values())
        self.hits_tokens = 0

    def has(self, index: int) -> bool:
        return index in self.files

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = load_file(str(self.files[index]))
        return t["input_ids"], t["states"]

    def put(self, index: int, ids: torch.Tensor, states: torch.Tensor) -> None:
        need = states.numel() * states.element_size() + ids.numel() * 8 + 256
        with self.lock:
            if index in self.files or self.bytes + need > self.limit:
                return
            dst = self.path / f"{index}.safetensors"
            tmp = self.path / f"{index}.tmp"
            save_file({"input_ids": ids.contiguous(), "states": states.contiguous()}, str(tmp))
            tmp.replace(dst)
            self.files[index] = dst
            self.bytes += dst.stat().st_size


class StreamFeatures:
    """Features from a vLLM engine fed the trainer's plan (see the module doc)."""

    def __init__(
        self,
        cfg,
        target,
        dataset,
        device: torch.device,
        dtype: torch.dtype,
        budget: int,
        rank: int = 0,
        world: int = 1,
        local_rank: int = 0,
    ):
        tcfg = target.config()
        text = tcfg.get("text_config", tcfg)
        self.aux_layers, self.final_layer = resolve_layers(int(text["num_hidden_layers"]), cfg.layers)
        self.hidden_size = int(text["hidden_size"])
        self.cfg, self.target, self.dataset, self.device, self.dtype = cfg, target, dataset, device, dtype
        self.budget, self.rank, self.world, self.local_rank = budget, rank, world, local_rank
        self.slots = len(self.aux_layers) + 1
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.limit = int(cfg.feature_buffer_gb * GB / world)
        biggest = unit_bytes(
            cfg.batch_size * budget, cfg.batch_size * budget, self.slots, self.hidden_size, self.itemsize
        )
        if biggest > self.limit:
            raise EyasError(
                f"--feature-buffer-gb {cfg.feature_buffer_gb:g}: {self.limit:,} bytes per rank ({world} rank(s)) "
                f"cannot hold one micro-batch's features ({cfg.batch_size} packs x {budget} tokens x "
                f"{self.slots} states x {self.hidden_size} x {self.itemsize} B: up to {biggest:,} bytes); raise "
                f"it to at least {biggest * world / GB:.3g} (or lower --batch-size / --tokens-per-batch)"
            )
        root = (
            Path(cfg.feature_buffer_dir) if cfg.feature_buffer_dir else default_buffer_dir(cfg.out, self.limit * world)
        )
        self.buffer = root / f"rank-{rank}"
        self.work = Path(cfg.out).resolve() / ".vllm-stream" / f"rank-{rank}"
        self.key = {
            "target": target.id,
            "dataset": dataset.manifest.get("id"),
            "aux": self.aux_layers,
            "final": self.final_layer,
            "dtype": str(dtype),
        }
        # what fixes the calls' names and packs: a chunk left by a run with other values serves other packs
        self.plan_key = {
            **self.key,
            **{
                k: getattr(cfg, k)
                for k in (
                    "seed",
                    "tokens_per_batch",
                    "batch_size",
                    "grad_accum",
                    "heldout",
                    "eval_every",
                    "eval_batches",
                )
            },
            "world": world,
        }
        self.own_root = not cfg.feature_buffer_dir
        cache_gb = float(cfg.feature_cache_gb or 0)
        self.cache = (
            FeatureCache(Path(cfg.out) / "feature-cache" / f"rank-{rank}", int(cache_gb * GB / world), self.key)
            if cache_gb > 0
            else None
        )
        self.feeder: Feeder | None = None
        self.wait_s, self.first_wait_s, self.calls, self.tokens_used = 0.0, None, 0, 0
        self.backend = self.message = None

    # ------------------------------------------------------------------ start

    def start(self, calls: Iterator[tuple[str, list[list[int]]]]) -> None:
        """Start the engine(s) and feed them ``calls`` ((name, packs) in the order :meth:`batch` will
        be called); chunks a killed run left in the buffer for these calls are used, the rest deleted."""
        from eyas.train.stream_engine import start_engines

        leftovers = self._open_buffer()
        engines, self.backend, self.message = start_engines(self, self.buffer, self.work)
        if self.rank == 0:
            print(
                f"eyas train: features from vLLM: {self.message}; buffer {self.buffer.parent} "
                f"(at most {self.limit * self.world / GB:g} GB), later epochs "
                f"{'cached up to %g GB' % self.cfg.feature_cache_gb if self.cache else 're-extracted'}",
                file=sys.stderr,
                flush=True,
            )
        self.feeder = Feeder(
            engines,
            self._units(calls),
            self.buffer,
            self.limit,
            self._prompts,
            self._estimate,
            self.cache.has if self.cache else (lambda i: False),
            float(self.cfg.feature_timeout),
            leftovers,
        )

    def _open_buffer(self) -> dict[str, Path]:
        """This rank's buffer directory, with the chunks a killed run left there for this resume (same
        target, data, layers, dtype and plan settings); any other chunk there is deleted."""
        self.buffer.mkdir(parents=True, exist_ok=True)
        marker = self.buffer / "buffer.json"
        same = bool(self.cfg.resume) and marker.is_file() and json.loads(marker.read_text()) == self.plan_key
        for raw in self.buffer.glob("raw-*"):
            shutil.rmtree(raw, ignore_errors=True)  # a killed engine's per-request files
        for tmp in self.buffer.glob(f".{PREFIX}*"):
            tmp.unlink()
        found = {p.name[len(PREFIX) : -len(".safetensors")]: p for p in list_chunks(self.buffer)}
        if not same:
            for p in found.values():
                p.unlink()
            found = {}
        marker.write_text(json.dumps(self.plan_key))
        return found

    def _units(self, calls: Iterator[tuple[str, list[list[int]]]]) -> Iterator[Unit]:
        for name, packs in calls:
            yield self._unit(name, packs)

    def _unit(self, name: str, packs: list[list[int]]) -> Unit:
        lens = self.dataset.lengths
        want = [(i, int(min(lens[i], self.budget))) for p in packs for i in p]
        return Unit(name, packs, want)

    def _prompts(self, ask: list[tuple[int, int]]) -> list:
        return [[i, np.asarray(self.dataset[i].input_ids[:k], dtype=np.int64).tolist()] for i, k in ask]

    def _estimate(self, ask: list[tuple[int, int]]) -> int:
        return unit_bytes(sum(k for _, k in ask), len(ask), self.slots, self.hidden_size, self.itemsize)

    # ------------------------------------------------------------------ batches

    def prefetch(self, packs: list[list[int]]) -> None:
        """Nothing to do: the engines already work ahead, as far as the buffer lets them."""

    def batch(self, packs: list[list[int]]) -> Batch:
        assert self.feeder is not None, "StreamFeatures.start() was not called"
        t = time.perf_counter()
        unit = self.feeder.take(packs, lambda n: self._unit(f"x-{n:06d}", packs))
        waited = time.perf_counter() - t
        self.wait_s += waited
        if self.first_wait_s is None:
            self.first_wait_s = waited
        lay = layout(packs, _samples(self.dataset, packs), self.budget)
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if unit.path is not None:
            meta, samples = read_chunk(unit.path)
            if meta.get("aux") is not None and [*meta["aux"], meta["final"]] != [*self.aux_layers, self.final_layer]:
                raise EyasError(
                    f"{unit.path}: states of layers {meta['aux']}+{meta['final']}, this run trains on "
                    f"{self.aux_layers}+{self.final_layer}; delete {self.buffer}"
                )
            got = {i: (ids, st) for i, ids, st in samples}
        b, t_ = lay.input_ids.shape
        hidden = torch.zeros((b, t_, self.slots, self.hidden_size), dtype=self.dtype)
        for r, row in enumerate(lay.spans):
            for i, start, _length, kept in row:
                if i in got:
                    ids, st = got[i]
                elif self.cache is not None and self.cache.has(i):
                    ids, st = self.cache.get(i)
                    self.cache.hits_tokens += kept
                else:
                    raise EyasError(
                        f"{unit.name}: the vLLM engine's chunk {unit.path} has no states for sample "
                        f"{i}; delete {self.buffer} and resume"
                    )
                if ids.shape[0] < kept or not torch.equal(ids[:kept].long(), lay.input_ids[r, start : start + kept]):
                    raise EyasError(
                        f"{unit.path}: the states of sample {i} were computed from other tokens than "
                        "the prepared dataset holds; delete the buffer directory "
                        f"{self.buffer} (left by another run?) and resume"
                    )
                hidden[r, start : start + kept] = st[:kept]
        if self.cache is not None:
            for i, (ids, st) in got.items():
                self.cache.put(i, ids, st)
        if unit.path is not None:
            unit.path.unlink(missing_ok=True)
            self.feeder.release(unit)
        self.calls += 1
        self.tokens_used += lay.num_tokens
        lay = pinned(lay, self.device)
        ids, mask, pos, doc = _to(lay, self.device)
        aux = hidden[:, :, :-1].flatten(2).to(self.device, non_blocking=True)
        final = hidden[:, :, -1].contiguous().to(self.device, non_blocking=True)
        return Batch(ids, mask, pos, doc, aux, final, lay.num_tokens, lay)

    # ------------------------------------------------------------------ end

    def close(self, ok: bool = True) -> None:
        """Stop the engines. After a finished run the buffer is emptied; after a failure the chunks made
        ahead stay for ``--resume``."""
        if self.feeder is None:
            return
        self.feeder.stop()
        if ok:
            shutil.rmtree(self.buffer, ignore_errors=True)
            if self.own_root:
                try:
                    self.buffer.parent.rmdir()  # the default root, once every rank's part is gone
                except OSError:
                    pass

    def report(self) -> dict[str, Any]:
        """What the run's features cost, for summary.json and features.json."""
        s = self.feeder.stats if self.feeder else None
        rep: dict[str, Any] = {
            "source": "vllm",
            "backend": self.backend,
            "engine": self.message,
            "later_epochs": "cached" if self.cache else "re-extracted",
            "feature_cache_gb": float(self.cfg.feature_cache_gb or 0),
            "buffer_dir": str(self.buffer),
            "buffer_limit_bytes": self.limit,
            "calls": self.calls,
            "tokens_trained": self.tokens_used,
            "trainer_wait_s": round(self.wait_s, 3),
            "first_call_wait_s": round(self.first_wait_s or 0.0, 3),
        }
        if s is not None:
            rep.update(
                {
                    "vllm": s.vllm_version,
                    "engine_start_s": s.engine_ready_s,
                    "requests": s.requests,
                    "tokens_extracted": s.tokens_extracted,
                    "samples_extracted": s.samples_extracted,
                    "engine_busy_s": round(s.engine_s, 3),
                    "engine_held_back_s": round(s.held_back_s, 3),
                    "engine_held_back_times": s.held_back_times,
                    "peak_buffer_bytes": s.peak_bytes,
                    "resumed_chunks_used": s.adopted,
                    "resumed_tokens_used": s.adopted_tokens,
                    "chunks_dropped": s.dropped,
                }
            )
        if self.cache is not None:
            rep.update(
                {
                    "cache_dir": str(self.cache.path),
                    "cache_bytes": self.cache.bytes,
                    "cache_samples": len(self.cache.files),
                    "tokens_from_cache": self.cache.hits_tokens,
                }
            )
        return rep
