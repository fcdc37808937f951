"""Generation engine: ``python -m eyas_vllm_worker.generate JOB.json`` inside the vLLM environment.

Serves `eyas prepare --regenerate`: one engine for the whole run (loading it is the slow part),
kept busy by a stream of prompts (``protocol.py``). eyas sends
``{"keys": [...], "prompts": [[ids]], "seeds": [...], "max_tokens", "temperature", "top_p",
"stop_token_ids", "low_water"}``: the prompts join the engine's queue, the engine steps until at
least one request has finished and at most ``low_water`` are unfinished, and answers with what
finished meanwhile: ``{"outputs": [{"key", "token_ids", "finish_reason"}]}``. eyas sends more
prompts with each request, so the batch never drains between requests (an answer's follow-up
turn is queued as soon as it is done). Only public entry points: ``LLM``, its ``llm_engine``
(``add_request``, ``step``), ``SamplingParams``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .batch import step_until
from .engine import compat_model_dir
from .protocol import Channel, guard_engine, read_job


def main(job_path: str) -> None:
    guard_engine()
    channel = Channel()
    job = read_job(job_path)
    from vllm import LLM, SamplingParams

    # started beside the engine before it, so the imports overlap; built only when told, as vLLM's
    # memory profiling must not see another engine starting
    if job.get("start_when_told") and not channel.wait_for("start"):
        return
    extra = {"max_num_seqs": job["max_num_seqs"]} if job.get("max_num_seqs") else {}
    llm = LLM(
        model=compat_model_dir(job["model"], Path(job["work_dir"])),
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        seed=job["seed"],
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.85),
        enable_prefix_caching=True,  # later turns share their conversation's prefix
        # ids in, ids out: eyas decodes, so vLLM's (older) transformers never reads the tokenizer
        skip_tokenizer_init=True,
        **extra,
    )
    import torch

    engine = llm.llm_engine
    try:  # only finished requests come out of step(): no per-token copies of 1,000 live answers
        from vllm.sampling_params import RequestOutputKind

        final_only = RequestOutputKind.FINAL_ONLY
    except ImportError:
        final_only = None
    # vLLM's CPU runner breaks on per-request seeds (its CPU generators have no offset to
    # rewind): there, sampling follows the engine seed alone
    per_request_seed = torch.cuda.is_available()
    channel.reply(
        {
            "ready": True,
            "per_request_seed": per_request_seed,
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
        }
    )
    for req in channel.requests():
        greedy = req["temperature"] <= 0
        for key, prompt, seed in zip(req["keys"], req["prompts"], req["seeds"]):
            # a seed per answer (eyas derives it from conversation and turn), not per batch
            params = SamplingParams(
                max_tokens=req["max_tokens"],
                temperature=0.0 if greedy else req["temperature"],
                top_p=1.0 if greedy else req["top_p"],
                seed=seed if per_request_seed and not greedy else None,
                stop_token_ids=req["stop_token_ids"],
                detokenize=False,
            )
            if final_only is not None:
                params.output_kind = final_only
            engine.add_request(str(key), {"prompt_token_ids": prompt}, params)
        done = step_until(
            engine,
            req.get("low_water", 0),
            lambda o: (
                {
                    "key": o.request_id,
                    "token_ids": list(o.outputs[0].token_ids),
                    "finish_reason": o.outputs[0].finish_reason,
                }
                if o.finished
                else None
            ),
        )
        channel.reply({"outputs": done})


if __name__ == "__main__":
    main(sys.argv[1])
