"""Streaming engine: ``python -m eyas_vllm_worker.stream JOB.json`` inside the vLLM environment.

Serves `eyas train --features vllm`: one engine for the whole run, fed one batch of prompts per
request (``protocol.py``) in the trainer's order. eyas sends
``{"name": "s000000012-m000", "prompts": [[index, [ids]], ...]}``; the engine runs them
prefill-only through the same paths as extraction (``engine.py``: the connector on vLLM >= 0.18,
the hooks before), leaves ``chunk-<name>.safetensors`` in the job's ``out_dir`` (the trainer's
bounded buffer) and answers ``{"name", "samples", "tokens", "bytes", "seconds"}``. It only runs
what it is sent: eyas holds requests back while its buffer is full.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .chunks import PREFIX
from .engine import build_llm, compat_model_dir
from .protocol import Channel, read_job


def main(job_path: str) -> None:
    channel = Channel()
    job = read_job(job_path)
    work = Path(job["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import vllm
    from vllm import SamplingParams

    from .engine import run_connector, run_hooks

    llm, layer_ids = build_llm(job, compat_model_dir(job["model"], work))
    if job["backend"] == "vllm-hooks":
        llm.collective_rpc("eyas_install", args=(job["aux"], job["final"], job["out_dir"], job["tag"]))
    channel.reply({"ready": True, "vllm": vllm.__version__, "pid": os.getpid(),
                   "seconds": round(time.time() - t0, 2)})
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for seq, req in enumerate(channel.requests()):
        t = time.time()
        batch = [(int(i), [int(x) for x in ids]) for i, ids in req["prompts"]]
        if job["backend"] == "vllm-hooks":
            written = run_hooks(llm, job, batch, sp, name=req["name"])
        else:
            written = run_connector(llm, job, batch, sp, layer_ids, seq, name=req["name"])
        path = Path(job["out_dir"]) / f"{PREFIX}{req['name']}.safetensors"
        channel.reply({"name": req["name"], "samples": len(written), "tokens": sum(len(x) for _, x in batch),
                       "bytes": path.stat().st_size, "seconds": round(time.time() - t, 4)})


if __name__ == "__main__":
    main(sys.argv[1])
