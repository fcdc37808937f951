"""The producer side of `eyas train --features vllm`: vLLM engines fed the trainer's plan, with
backpressure on a bounded buffer directory.

The trainer's calls for features (one per micro-batch, and the held-out batches of each planned
evaluation) are known in advance, in order: a *plan* of :class:`Unit` s whose names sort in plan
order. One thread per engine takes the next unit nobody has sent, and sends it only once the
buffer has room for it: the bytes of the chunk files waiting there plus an upper bound of those
being made (:func:`unit_bytes`) stay within the limit. The consumer (``eyas.train.stream``) takes
the units in order, reads their chunk files and deletes each once its batch is built, which frees
the room. An engine that dies, or sends nothing for ``timeout`` seconds, stops the consumer with
the engine's own log lines; nothing waits forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from eyas.errors import EyasError
from eyas.vllm.process import WorkerProcess
from eyas.vllm.worker.chunks import PREFIX

# a chunk's safetensors header (4 tensors and the layer ids as metadata), generously
CHUNK_HEADER = 4096
PER_SAMPLE = 600  # per sample: indices and offsets entries, and the connector's own file header
AHEAD = 256  # units planned ahead at most (cached units take no room, so room alone does not bound it)


def unit_bytes(tokens: int, samples: int, slots: int, hidden: int, itemsize: int) -> int:
    """An upper bound of the bytes one request's states take in the buffer directory at any moment.

    The chunk holds ``tokens x slots x hidden`` states plus an int64 token id per token. Before it is
    written, the connector's per-request files hold the same states (vLLM's layer order, its token
    ids); the engine reads and deletes them first (``worker/engine.py``), so the two never add up."""
    return tokens * (slots * hidden * itemsize + 8) + samples * PER_SAMPLE + CHUNK_HEADER


def engine_words(e: WorkerProcess) -> str:
    """vLLM's own words from an engine's log: its error lines (not those of warnings), then its last lines."""
    tail = e.tail(10)
    lines = e.log_path.read_text(errors="replace").splitlines() if e.log_path.is_file() else []
    errors = "\n".join([ln for ln in lines if ("Error" in ln or "error:" in ln) and " WARNING " not in ln][-6:])
    if not errors or errors in tail:
        return f"Its log is {e.log_path}; the last lines:\n{tail}"
    return f"Its log is {e.log_path}; error lines:\n{errors}\nthe last lines:\n{tail}"


@dataclass
class Unit:
    """One call of the trainer for features: its packs and the samples they hold."""

    name: str  # sorts in plan order (see eyas.train.stream.unit_name)
    packs: list[list[int]]
    want: list[tuple[int, int]]  # (sample index, tokens used) in pack order
    ask: list[tuple[int, int]] = field(default_factory=list)  # sent to the engine (not cached at send time)
    state: str = "planned"  # planned -> sent -> ready
    est: int = 0  # bytes reserved while it is made
    bytes: int = 0  # its chunk's bytes once made
    path: Path | None = None
    seconds: float = 0.0  # the engine's time for it


@dataclass
class FeedStats:
    engine_ready_s: list[float] = field(default_factory=list)
    vllm_version: str | None = None
    requests: int = 0
    tokens_extracted: int = 0
    samples_extracted: int = 0
    engine_s: float = 0.0
    held_back_s: float = 0.0  # engine idle because the buffer was full (summed over engines)
    held_back_times: int = 0
    peak_bytes: int = 0  # the accounting's peak: chunks waiting + reserved for chunks being made
    adopted: int = 0  # chunks left by a killed run and used by this one
    adopted_tokens: int = 0
    dropped: int = 0  # chunks made ahead and not used (a changed plan, an early stop)


class Feeder:
    """Feeds ``engines`` the units of ``plan`` in order, within ``limit`` bytes in ``buffer``."""

    def __init__(
        self,
        engines: list[WorkerProcess],
        plan: Iterator[Unit],
        buffer: Path,
        limit: int,
        prompts: Callable[[list[tuple[int, int]]], list],
        estimate: Callable[[list[tuple[int, int]]], int],
        cached: Callable[[int], bool],
        timeout: float,
        leftovers: dict[str, Path] | None = None,
    ):
        self.engines, self.plan, self.buffer, self.limit = engines, plan, buffer, limit
        self.prompts, self.estimate, self.cached, self.timeout = prompts, estimate, cached, timeout
        self.cond = threading.Condition()
        self.queue: deque[Unit] = deque()
        self.used = 0  # bytes of chunk files in the buffer (made, not yet consumed)
        self.reserved = 0  # upper bound of the bytes of chunks being made
        self.leftovers = dict(sorted((leftovers or {}).items()))
        self.used += sum(p.stat().st_size for p in self.leftovers.values())
        self.stats = FeedStats(peak_bytes=self.used)
        self.error: BaseException | None = None
        self.stopping = False
        self.last_progress = time.monotonic()
        self._extra = 0
        self.phase = ["starting"] * len(engines)  # per engine: starting, idle or request
        self.threads = [
            threading.Thread(target=self._serve, args=(k, e), name=f"eyas-feed-{k}", daemon=True)
            for k, e in enumerate(engines)
        ]
        for t in self.threads:
            t.start()

    # ------------------------------------------------------------------ producer threads

    def _pull(self) -> Unit | None:
        """The plan's next unit, into the queue (under the lock); a chunk a killed run left for it is used."""
        if self.plan is None or len(self.queue) >= AHEAD:
            return None
        u = next(self.plan, None)
        if u is None:
            self.plan = None
            return None
        old = self.leftovers.pop(u.name, None)
        if old is not None:
            u.state, u.path, u.bytes = "ready", old, old.stat().st_size
            self.stats.adopted += 1
            self.stats.adopted_tokens += sum(k for _, k in u.want)
        self._drop_leftovers_before(u.name)
        self.queue.append(u)
        return u

    def _drop_leftovers_before(self, name: str) -> None:
        for old in [n for n in self.leftovers if n < name]:
            self._unlink(self.leftovers.pop(old))

    def _unlink(self, path: Path) -> None:
        size = path.stat().st_size if path.exists() else 0
        path.unlink(missing_ok=True)
        self.used -= size
        self.stats.dropped += 1

    def _next_to_send(self) -> Unit | None:
        for u in self.queue:
            if u.state == "planned":
                return u
        while True:
            u = self._pull()
            if u is None or u.state == "planned":
                return u

    def _room(self, need: int) -> bool:
        if self.used + self.reserved + need <= self.limit:
            return True
        if self.leftovers:  # a killed run's chunks further ahead must not block what is needed now
            self._unlink(self.leftovers.pop(max(self.leftovers)))
            return self._room(need)
        return False

    def _serve(self, k: int, engine: WorkerProcess) -> None:
        try:
            ready = engine.read()  # the engine's start-up: vLLM loads the model
            with self.cond:
                self.phase[k] = "idle"
                self.stats.engine_ready_s.append(float(ready.get("seconds", 0.0)))
                self.stats.vllm_version = ready.get("vllm")
                self.last_progress = time.monotonic()
                self.cond.notify_all()
            while True:
                with self.cond:
                    waited = None
                    while True:
                        if self.stopping:
                            return
                        u = self._next_to_send()
                        if u is None:
                            self.cond.wait(0.5)
                            continue
                        u.ask = [w for w in u.want if not self.cached(w[0])]
                        if not u.ask:  # every sample in the cache: nothing to make
                            u.state = "ready"
                            self.cond.notify_all()
                            continue
                        u.est = self.estimate(u.ask)
                        if self._room(u.est):
                            break
                        if waited is None:
                            waited = time.monotonic()
                            self.stats.held_back_times += 1
                        self.cond.wait(0.5)
                    if waited is not None:
                        self.stats.held_back_s += time.monotonic() - waited
                    u.state = "sent"
                    self.reserved += u.est
                    self.stats.peak_bytes = max(self.stats.peak_bytes, self.used + self.reserved)
                    prompts = self.prompts(u.ask)
                    self.phase[k] = "request"
                reply = engine.request({"name": u.name, "prompts": prompts})
                with self.cond:
                    self.phase[k] = "idle"
                    self.reserved -= u.est
                    u.path = self.buffer / f"{PREFIX}{u.name}.safetensors"
                    u.bytes, u.seconds = int(reply["bytes"]), float(reply["seconds"])
                    self.used += u.bytes
                    self.stats.peak_bytes = max(self.stats.peak_bytes, self.used + self.reserved)
                    self.stats.requests += 1
                    self.stats.tokens_extracted += int(reply["tokens"])
                    self.stats.samples_extracted += int(reply["samples"])
                    self.stats.engine_s += u.seconds
                    u.state = "ready"
                    self.last_progress = time.monotonic()
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    # ------------------------------------------------------------------ the consumer's side

    def take(self, packs: list[list[int]], on_demand: Callable[[int], Unit]) -> Unit:
        """The unit of this call, once its chunk is made. A call the plan does not have next (a run
        stopped early by its time budget, then evaluated) drops the rest of the plan and is made on
        demand (``on_demand(n)`` builds its unit)."""
        with self.cond:
            head = self.queue[0] if self.queue else self._pull()
            if head is None or head.packs != packs:
                self._replan()
                self._extra += 1
                head = on_demand(self._extra)
                self.queue.append(head)
                self.cond.notify_all()
            self._wait(lambda: head.state == "ready", f"the features of {head.name}")
            self.queue.popleft()
            self._drop_leftovers_before(head.name)
            return head

    def release(self, unit: Unit) -> None:
        """``unit``'s chunk was read and deleted: its bytes are free."""
        with self.cond:
            self.used -= unit.bytes
            unit.bytes = 0
            self.cond.notify_all()

    def _replan(self) -> None:
        self.plan = None
        for u in [u for u in self.queue if u.state == "planned"]:
            self.queue.remove(u)
        self._wait(lambda: all(u.state != "sent" for u in self.queue), "the engine's requests in flight")
        for u in list(self.queue):
            if u.path is not None:
                self._unlink(u.path)
            self.queue.remove(u)
        for name in list(self.leftovers):
            self._unlink(self.leftovers.pop(name))

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        while not done():
            self.check()
            if time.monotonic() - self.last_progress > self.timeout:
                raise EyasError(
                    f"waited {self.timeout:.0f} s for {what}: no vLLM engine made anything in "
                    f"that time (--feature-timeout). {engine_words(self.engines[0])}"
                )
            self.cond.wait(0.5)

    def check(self) -> None:
        """Raise if an engine died or a producer failed, with the exit code and vLLM's own last lines."""
        for e in self.engines:
            code = e.poll()
            if code is not None:
                raise EyasError(
                    f"{e.describe} exited with code {code} while making training features; "
                    f"training stops (resume with --resume). {engine_words(e)}"
                )
        if self.error is not None:
            if isinstance(self.error, EyasError):
                raise EyasError(f"vLLM engine failed while making training features: {self.error}")
            raise EyasError(f"feeding the vLLM engine failed: {self.error!r}") from self.error

    def stop(self, join_s: float = 120.0) -> None:
        """Stop the producer threads and the engines: an engine still starting is terminated, a request
        in flight is finished first (up to ``join_s``), an idle engine is asked to quit."""
        with self.cond:
            self.stopping = True
            starting = [k for k, ph in enumerate(self.phase) if ph == "starting"]
            self.cond.notify_all()
        for k in starting:
            self.engines[k].stop()  # its thread's read of the ready reply then ends
        deadline = time.monotonic() + join_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for t, e in zip(self.threads, self.engines):
            if t.is_alive():
                e.stop()  # still waits on its reply: terminate, its read then ends
            else:
                e.close(timeout=60)

    def pending_files(self) -> list[Path]:
        with self.cond:
            return [u.path for u in self.queue if u.path is not None]
