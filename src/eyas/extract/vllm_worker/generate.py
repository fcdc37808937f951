"""Generation engine: ``python -m eyas_vllm_worker.generate JOB.json`` inside the vLLM environment.

Serves `eyas prepare --regenerate`: one engine for the whole run (loading it is the slow part),
fed one batch of prompts per request. Protocol, one JSON object per line: eyas writes
``{"prompts": [[ids]], "max_tokens", "temperature", "top_p", "seeds", "stop_token_ids"}`` to
stdin; the engine answers ``{"outputs": [{"token_ids": [...], "finish_reason": ...}]}`` on the
stdout it had at start. vLLM's own prints go to stderr (the log), so they cannot corrupt the
protocol. Only public entry points: ``LLM``, ``SamplingParams``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .engine import compat_model_dir


def main(job_path: str) -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else printed to fd 1 lands in the log
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(model=compat_model_dir(job["model"], Path(job["work_dir"])), dtype=job["dtype"],
              max_model_len=job["max_model_len"], seed=job["seed"],
              tensor_parallel_size=job.get("tensor_parallel_size", 1),
              gpu_memory_utilization=job.get("gpu_memory_utilization", 0.85),
              enable_prefix_caching=True,  # later turns share their conversation's prefix
              # ids in, ids out: eyas decodes, so vLLM's (older) transformers never reads the tokenizer
              skip_tokenizer_init=True)
    import torch

    # vLLM's CPU runner breaks on per-request seeds (its CPU generators have no offset to
    # rewind): there, sampling follows the engine seed alone
    per_request_seed = torch.cuda.is_available()
    reply.write(json.dumps({"ready": True, "per_request_seed": per_request_seed}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        greedy = req["temperature"] <= 0
        # a seed per prompt (eyas derives it from conversation and turn), not per batch
        params = [SamplingParams(max_tokens=req["max_tokens"], temperature=0.0 if greedy else req["temperature"],
                                 top_p=1.0 if greedy else req["top_p"],
                                 seed=req["seeds"][k] if per_request_seed and not greedy else None,
                                 stop_token_ids=req["stop_token_ids"], detokenize=False)
                  for k in range(len(req["prompts"]))]
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
        reply.write(json.dumps({"outputs": [
            {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
            for o in outs]}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
