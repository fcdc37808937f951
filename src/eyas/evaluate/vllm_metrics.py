"""The `vllm` engine: generation in a vLLM environment, tau and per-position acceptance read from
vLLM's own spec-decode counters (``llm.get_metrics()``).

vLLM lives in another interpreter (``.venvs/vllm-X``); ``vllm_worker.py`` runs there as a child
process and answers one JSON line per request, so counters can be attributed to each prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

WORKER = Path(__file__).with_name("vllm_worker.py")
PREFIX = "EYAS-JSON "


def find_vllm_python(spec: str | None = None) -> Path:
    """``--vllm``: a python, a venv dir or a version; unset, the same search as extraction's
    (``$EYAS_VLLM_PYTHON``, this Python, the newest ``.venvs/vllm-*``)."""
    from eyas.extract.vllm_backend import find_vllm_python as find

    return Path(find(spec, flag="--vllm")[0])


class VllmEngine:
    """A vLLM ``LLM`` (optionally with an EAGLE-3 draft) in a child process."""

    def __init__(self, python: Path, target_dir: Path, draft_dir: Path | None, k: int = 3,
                 dtype: str = "float32", max_model_len: int | None = None, seed: int = 0,
                 log_path: Path | None = None, kv_cache_gib: int = 2):
        self.opts = {"target": str(target_dir), "draft": str(draft_dir) if draft_dir else None,
                     "k": k, "dtype": dtype, "max_model_len": max_model_len, "seed": seed}
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        env.pop("PYTHONPATH", None)  # the child must see its own env's packages only
        self.log_path = log_path
        self._log = open(log_path, "a") if log_path else None
        self._tail: deque[str] = deque(maxlen=40)
        self.proc = subprocess.Popen([str(python), str(WORKER), json.dumps(self.opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        self.info = self._read()
        if "error" in self.info:
            self.close()
            raise EyasError(self.info["error"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
            self._tail.append(line.rstrip())
            if self._log:
                self._log.write(line)
        code = self.proc.wait()
        tail = "\n".join(self._tail)
        raise EyasError(f"vLLM worker ({self.opts['target']}, draft {self.opts['draft']}) exited with "
                        f"code {code}; last output:\n{tail}"
                        + (f"\n(full log: {self.log_path})" if self.log_path else ""))

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                 temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        return self._ask({"prompt_token_ids": prompt, "max_tokens": max_new_tokens,
                          "temperature": temperature, "stop_token_ids": sorted(stop_ids), "seed": seed})

    def speed(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
              concurrency: int) -> dict[str, Any]:
        """Greedy wall-clock tokens/s over ``prompts`` with ``concurrency`` requests in flight."""
        return self._ask({"op": "speed", "prompts": prompts, "max_tokens": max_new_tokens,
                          "stop_token_ids": sorted(stop_ids), "concurrency": concurrency})

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # _read reports the exit and the log tail
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self._log:
            self._log.close()

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
