"""The `vllm` engine: generation in a vLLM environment, tau and per-position acceptance read from
vLLM's own spec-decode counters (``llm.get_metrics()``).

vLLM lives in another interpreter (``.venvs/vllm-X``); the worker package's ``serve`` module runs
there as a child process (:mod:`eyas.vllm.process`) and answers one request at a time, so counters
can be attributed to each prompt.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.vllm.process import WorkerProcess


def find_vllm_python(spec: str | None = None) -> Path:
    """``--vllm``: a python, a venv dir or a version; unset, the same search as extraction's
    (``$EYAS_VLLM_PYTHON``, this Python, the newest ``.venvs/vllm-*``)."""
    from eyas.vllm.find import find_vllm_python as find

    return Path(find(spec, flag="--vllm")[0])


class VllmEngine:
    """A vLLM ``LLM`` (optionally with an EAGLE-3 draft) in a child process."""

    def __init__(self, python: Path, target_dir: Path, draft_dir: Path | None, k: int = 3,
                 dtype: str = "float32", max_model_len: int | None = None, seed: int = 0,
                 log_path: Path | None = None, kv_cache_gib: int = 2):
        self.opts = {"target": str(Path(target_dir).resolve()),
                     "draft": str(Path(draft_dir).resolve()) if draft_dir else None,
                     "k": k, "dtype": dtype, "max_model_len": max_model_len, "seed": seed}
        self._work = Path(tempfile.mkdtemp(prefix="eyas-vllm-serve-"))  # the job and its worker package
        self.log_path = Path(log_path) if log_path else self._work / "vllm.log"
        self.proc = WorkerProcess(python, "serve", self.opts, self._work, self.log_path,
                                  env={} if "VLLM_CPU_KVCACHE_SPACE" in os.environ
                                  else {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)},
                                  describe=f"vLLM worker ({self.opts['target']}, draft {self.opts['draft']})")
        try:
            self.info = self.proc.read()
        except EyasError:
            self.close()
            raise

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                 temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        return self.proc.request({"prompt_token_ids": prompt, "max_tokens": max_new_tokens,
                                  "temperature": temperature, "stop_token_ids": sorted(stop_ids), "seed": seed})

    def speed(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
              concurrency: int) -> dict[str, Any]:
        """Greedy wall-clock tokens/s over ``prompts`` with ``concurrency`` requests in flight."""
        return self.proc.request({"op": "speed", "prompts": prompts, "max_tokens": max_new_tokens,
                                  "stop_token_ids": sorted(stop_ids), "concurrency": concurrency})

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
        raise EyasError("vLLM reported no spec-decode metrics (vllm:spec_decode_num_drafts / "
                        "..._num_accepted_tokens_per_pos); is speculative decoding active and this "
                        "vLLM version >= 0.10?")
    per_pos = [int(x) for x in per_pos] + [0] * max(0, k - len(per_pos))
    return {"rounds": int(drafts), "draft_tokens": int(spec.get("vllm:spec_decode_num_draft_tokens") or 0),
            "accepted_per_pos": per_pos[:k]}



class VllmSpecEngine:
    """Adapter: a VllmEngine with a draft, answering in the evaluation record schema."""

    def __init__(self, engine: VllmEngine, k: int, temperature: float = 0.0, seed: int = 0):
        self.engine, self.k, self.temperature, self.seed = engine, k, temperature, seed

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> dict[str, Any]:
        reply = self.engine.generate(prompt, max_new_tokens, stop_ids, self.temperature, self.seed)
        return {"tokens": reply["token_ids"], "seconds": reply["seconds"], **spec_record(reply, self.k)}
