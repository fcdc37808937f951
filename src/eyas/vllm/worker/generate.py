"""Generation engine: ``python -m eyas_vllm_worker.generate JOB.json`` inside the vLLM environment.

Serves `eyas prepare --regenerate`: one engine for the whole run (loading it is the slow part),
fed one batch of prompts per request (``protocol.py``): eyas sends
``{"prompts": [[ids]], "max_tokens", "temperature", "top_p", "seeds", "stop_token_ids"}``; the
engine answers ``{"outputs": [{"token_ids": [...], "finish_reason": ...}]}``. Only public entry
points: ``LLM``, ``SamplingParams``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .engine import compat_model_dir
from .protocol import Channel, read_job


def main(job_path: str) -> None:
    channel = Channel()
    job = read_job(job_path)
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
    channel.reply({"ready": True, "per_request_seed": per_request_seed})
    for req in channel.requests():
        greedy = req["temperature"] <= 0
        # a seed per prompt (eyas derives it from conversation and turn), not per batch
        params = [SamplingParams(max_tokens=req["max_tokens"], temperature=0.0 if greedy else req["temperature"],
                                 top_p=1.0 if greedy else req["top_p"],
                                 seed=req["seeds"][k] if per_request_seed and not greedy else None,
                                 stop_token_ids=req["stop_token_ids"], detokenize=False)
                  for k in range(len(req["prompts"]))]
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
        channel.reply({"outputs": [
            {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
            for o in outs]})


if __name__ == "__main__":
    main(sys.argv[1])
