"""The `vllm` engine: generation in a vLLM environment, with tau and per-position acceptance per
request.

vLLM lives in another interpreter (``.venvs/vllm-X``); the worker package's ``serve`` module runs
there as a child process (:mod:`eyas.vllm.process`). The evaluation streams the questions through
one engine, many at once (:class:`VllmPool`): each request's acceptance is read from the tokens it
gained at each engine step (one verification round each), which every vLLM version reports. Where
vLLM also keeps per-request acceptance itself (0.31 and later), the two are compared request by
request. One request alone (:meth:`VllmEngine.generate`) also returns vLLM's global spec-decode
counters over it (``llm.get_metrics()``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from eyas.errors import EyasError
from eyas.evaluate.prompts import Question, render_turn
from eyas.evaluate.speculative import steps_record
from eyas.vllm.process import WorkerProcess


def find_vllm_python(spec: str | None = None) -> Path:
    """``--vllm``: a python, a venv dir or a version; unset, the same search as extraction's
    (``$EYAS_VLLM_PYTHON``, this Python, the newest ``.venvs/vllm-*``)."""
    from eyas.vllm.find import find_vllm_python as find

    return Path(find(spec, flag="--vllm")[0])


class VllmEngine:
    """A vLLM ``LLM`` (optionally with an EAGLE-3 draft) in a child process."""

    def __init__(
        self,
        python: Path,
        target_dir: Path,
        draft_dir: Path | None,
        k: int = 3,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
        log_path: Path | None = None,
        kv_cache_gib: int = 2,
        speculative_options: dict[str, Any] | None = None,
        profile_dir: Path | None = None,
    ):
        self.opts = {
            "target": str(Path(target_dir).resolve()),
            "draft": str(Path(draft_dir).resolve()) if draft_dir else None,
            "k": k,
            "speculative_options": dict(speculative_options or {}),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "seed": seed,
            # vLLM's torch profiler behind `profile` (its trace files go there)
            "profile_dir": str(Path(profile_dir).resolve()) if profile_dir else None,
        }
        self._work = Path(tempfile.mkdtemp(prefix="eyas-vllm-serve-"))  # the job and its worker package
        self.log_path = Path(log_path) if log_path else self._work / "vllm.log"
        self.proc = WorkerProcess(
            python,
            "serve",
            self.opts,
            self._work,
            self.log_path,
            env={} if "VLLM_CPU_KVCACHE_SPACE" in os.environ else {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)},
            describe=f"vLLM worker ({self.opts['target']}, draft {self.opts['draft']})",
        )
        try:
            self.info = self.proc.read()
        except EyasError:
            self.close()
            raise

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: set[int],
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> dict[str, Any]:
        return self.proc.request(
            {
                "prompt_token_ids": prompt,
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "stop_token_ids": sorted(stop_ids),
                "seed": seed,
            }
        )

    def stream(
        self, items: list[tuple[str, list[int], int]], max_tokens: int, temperature: float, low_water: int
    ) -> list[dict[str, Any]]:
        """Add ``items`` (key, prompt ids, sampling seed) to the engine's batch; return the requests
        that finished once at most ``low_water`` are left (at least one): ids, tokens gained per
        step, seconds."""
        return self.proc.request(
            {
                "op": "stream",
                "max_tokens": max_tokens,
                "temperature": temperature,
                "items": [{"key": key, "prompt_token_ids": ids, "seed": seed} for key, ids, seed in items],
                "low_water": low_water,
            }
        )["outputs"]

    def speed(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: set[int],
        concurrency: int,
        min_seconds: float = 0.0,
        min_waves: int = 1,
        load: str = "steady",
    ) -> dict[str, Any]:
        """Greedy wall-clock tokens/s with ``concurrency`` requests, ``prompts`` taken round and
        round, until at least ``min_waves`` times ``concurrency`` requests and ``min_seconds``;
        ``load`` steady (always ``concurrency`` in flight) or waves (the worker's ``speed``)."""
        return self.proc.request(
            {
                "op": "speed",
                "prompts": prompts,
                "max_tokens": max_new_tokens,
                "stop_token_ids": sorted(stop_ids),
                "concurrency": concurrency,
                "min_seconds": min_seconds,
                "min_waves": min_waves,
                "load": load,
            }
        )

    def profile(
        self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], steps: int, warm: int = 8
    ) -> dict[str, Any]:
        """``steps`` engine steps at one request under vLLM's torch profiler (the engine must have
        been started with ``profile_dir``), after ``warm`` untraced ones; the trace lands in
        ``profile_dir``."""
        if not self.opts["profile_dir"]:
            raise ValueError("VllmEngine.profile needs an engine started with profile_dir")
        return self.proc.request(
            {
                "op": "profile",
                "prompts": prompts,
                "max_tokens": max_new_tokens,
                "stop_token_ids": sorted(stop_ids),
                "steps": steps,
                "warm": warm,
            }
        )

    def close(self) -> None:
        self.proc.close()
        # the work dir goes, unless it holds the log of a worker that failed (named in the error)
        if self.log_path.parent != self._work or self.proc.poll() == 0:
            shutil.rmtree(self._work, ignore_errors=True)
        else:
            shutil.rmtree(self._work / "pkg", ignore_errors=True)

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spec_record(reply: dict[str, Any], k: int) -> dict[str, Any]:
    """Per-prompt numbers from vLLM's counters, in the report's per-prompt schema."""
    spec = reply.get("spec") or {}
    drafts = spec.get("vllm:spec_decode_num_drafts")
    per_pos = spec.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if drafts is None or per_pos is None:
        raise EyasError(
            "vLLM reported no spec-decode metrics (vllm:spec_decode_num_drafts / "
            "..._num_accepted_tokens_per_pos); is speculative decoding active and this "
            "vLLM version >= 0.10?"
        )
    per_pos = [int(x) for x in per_pos] + [0] * max(0, k - len(per_pos))
    return {
        "rounds": int(drafts),
        "draft_tokens": int(spec.get("vllm:spec_decode_num_draft_tokens") or 0),
        "accepted_per_pos": per_pos[:k],
    }


def agrees_with_vllm(steps: list[int], vllm_accepted: list[int]) -> bool:
    """Whether the drafts accepted per round, read from the tokens gained per step, are vLLM's own
    per-request counts (its last round may have been cut by ``max_tokens``: it may only be less)."""
    ours = [n - 1 for n in steps[1:]]
    if len(ours) != len(vllm_accepted):
        return False
    return ours[:-1] == vllm_accepted[:-1] and (not ours or ours[-1] <= vllm_accepted[-1])


class VllmPool:
    """``pool(questions)`` yields each question's records once its last turn is answered; up to
    ``in_flight`` questions share the engine's batch, and a question's next turn joins it as soon
    as the turn before is back.

    Each request asks for ``max_new_tokens + k + 1`` tokens without stopping, so every round that
    starts inside the answer is seen whole (:func:`steps_record` cuts the answer). ``checked``
    counts the requests compared with vLLM's own per-request acceptance, ``disagreed`` those that
    differed (a version whose steps eyas reads wrongly)."""

    def __init__(
        self,
        engine: VllmEngine,
        k: int,
        temperature: float,
        seed: int,
        tokenizer,
        max_new_tokens: int,
        stop_ids: set[int],
        in_flight: int,
    ):
        self.engine, self.k, self.temperature, self.seed = engine, k, temperature, seed
        self.tokenizer, self.max_new_tokens, self.stop_ids = tokenizer, max_new_tokens, stop_ids
        self.in_flight = max(1, in_flight)
        self.checked = self.disagreed = 0

    def __call__(self, questions: list[Question]) -> Iterator[list[dict[str, Any]]]:
        from eyas.evaluate.runner import turn_record

        todo = deque((q, 0, [], []) for q in questions)  # question, turn, answers so far, records so far
        live: dict[str, tuple[Question, int, list[str], list[dict], list[int]]] = {}
        while todo or live:
            send = []
            while todo and len(live) < self.in_flight:
                q, turn, answers, recs = todo.popleft()
                prompt = render_turn(self.tokenizer, q, turn, answers)
                key = f"{q.question_id}/{turn}"
                live[key] = (q, turn, answers, recs, prompt)
                # a seed per turn from the run's seed, so a sampled answer does not depend on its batch
                send.append((key, prompt, (self.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**31))
            outs = self.engine.stream(send, self.max_new_tokens + self.k + 1, self.temperature, low_water=len(live) - 1)
            for out in outs:
                q, turn, answers, recs, prompt = live.pop(out["key"])
                got = {
                    **steps_record(out["token_ids"], out["steps"], self.max_new_tokens, self.stop_ids, self.k),
                    "seconds": out["seconds"],
                }
                if "vllm_per_step_accepted" in out:
                    self.checked += 1
                    self.disagreed += not agrees_with_vllm(out["steps"], out["vllm_per_step_accepted"])
                rec, answer = turn_record(q, turn, prompt, got, self.tokenizer, self.stop_ids)
                if turn + 1 < len(q.turns):  # ahead of new questions: finished questions free the batch
                    todo.appendleft((q, turn + 1, answers + [answer], recs + [rec]))
                else:
                    yield recs + [rec]
