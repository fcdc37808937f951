"""Engine process: ``python -m eyas_vllm_worker.engine JOB.json`` inside the vLLM environment.

Runs the target prefill-only (``max_tokens=1``) over the job's prompts and leaves packed chunk
files (see ``chunks.py``) in the job's ``out_dir``; eyas collects them into its store. Two ways
to get the states, chosen by ``job["backend"]``:

- ``vllm-hooks`` (vLLM 0.12-0.17): ``worker_extension_cls`` + ``collective_rpc`` install forward
  hooks in the worker, which writes the chunks itself (see ``hooks.py``).
- ``vllm`` (vLLM >= 0.18): the ``extract_hidden_states`` speculative method with eyas's
  hidden-states connector (see ``connector.py``); this process repacks the per-request files.

Only vLLM's public entry points are used here (``LLM``, ``SamplingParams``, ``collective_rpc``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .protocol import guard_engine

PKG = __package__ or "eyas_vllm_worker"


def log(event: str, **fields) -> None:
    print(json.dumps({"eyas": event, **fields}), flush=True)


def load_prompts(path: str) -> list[tuple[int, list[int]]]:
    z = np.load(path)
    idx, off, flat = z["indices"], z["offsets"], z["flat"]
    return [(int(idx[j]), flat[off[j] : off[j + 1]].astype(np.int64).tolist()) for j in range(len(idx))]


def compat_model_dir(model: str, work: Path) -> str:
    """A view of ``model`` whose config.json also reads right under transformers 4.x.

    transformers 5 writes ``rope_parameters`` (no top-level ``rope_theta``) and ``dtype``; the
    transformers 4.57 that vLLM 0.16 pins would silently fall back to rope_theta=10000. The view
    symlinks every file and rewrites only config.json; the original directory is untouched.
    """
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return model
    src = Path(model)
    cfg = json.loads((src / "config.json").read_text())
    changed = False
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp and "rope_theta" not in cfg:
            cfg["rope_theta"] = rp["rope_theta"]
            changed = True
        if rp.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
            changed = True
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
        changed = True
    if not changed:
        return model
    view = work / "model-view"
    view.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = view / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    log("compat-config", view=str(view), rope_theta=cfg.get("rope_theta"))
    return str(view)


def build_llm(job: dict, model_dir: str):
    from vllm import LLM

    layer_ids = sorted(set(job["aux"]) | {job["final"]})
    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,  # prompts arrive as token ids; no tokenizer compatibility issues
        dtype=job.get("dtype", "auto"),
        enforce_eager=True,  # hooks need eager modules; also fastest start-up for prefill-only
        enable_prefix_caching=False,  # every prompt token must be computed, none reused
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=max(job["max_model_len"], job.get("max_num_batched_tokens", 8192)),
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        seed=job.get("seed", 0),
    )
    if job["backend"] == "vllm-hooks":
        kwargs["enable_chunked_prefill"] = False  # each prompt is computed in one piece
        kwargs["worker_extension_cls"] = f"{PKG}.hooks.EyasHookExtension"
    else:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        }
        kwargs["kv_transfer_config"] = {
            "kv_connector": "EyasHiddenStatesConnector",
            "kv_connector_module_path": f"{PKG}.connector",
            "kv_role": "kv_producer",
            # the per-request files; the streaming engine puts them in the trainer's bounded buffer
            "kv_connector_extra_config": {
                "shared_storage_path": job.get("raw_dir") or str(Path(job["work_dir"]) / "raw")
            },
        }
    kwargs.update(job.get("engine_kwargs") or {})
    return LLM(**kwargs), layer_ids


def batches(prompts: list, max_tokens: int):
    cur, n = [], 0
    for p in prompts:
        if cur and n + len(p[1]) > max_tokens:
            yield cur
            cur, n = [], 0
        cur.append(p)
        n += len(p[1])
    if cur:
        yield cur


def run_hooks(llm, job: dict, batch: list, sp, name: str | None = None) -> list[int]:
    """One batch through the hooks; ``name``: the chunk's name (default: the job's tag and a count)."""
    llm.collective_rpc("eyas_expect", args=([[i, ids] for i, ids in batch],))
    llm.generate([{"prompt_token_ids": ids} for _, ids in batch], sp, use_tqdm=False)
    report = next(r for r in llm.collective_rpc("eyas_flush", args=(name,)) if r is not None)
    if report["missing"]:
        raise RuntimeError(
            f"eyas vllm-hooks: no states captured for {len(report['missing'])} prompt(s) "
            f"(e.g. index {report['missing'][:5]}); {report['stray_runs']} token runs matched no "
            "prompt. vLLM split or reused prompts (chunked prefill / prefix caching) or compiled "
            "the model; nothing of this batch is missing from the chunk files silently."
        )
    return report["written"]


def run_connector(
    llm, job: dict, batch: list, sp, layer_ids: list[int], seq: int, name: str | None = None
) -> list[int]:
    """One batch through the connector, repacked as one chunk (``name``, default the job's tag and
    ``seq``). Each request's own file is read and deleted before the chunk is written, so the
    batch's states are on disk once at a time, never twice."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    from .chunks import write_chunk

    order = [layer_ids.index(k) for k in [*job["aux"], job["final"]]]
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in batch], sp, use_tqdm=False)
    samples = []
    for out, (index, ids) in zip(outs, batch):
        params = out.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"eyas vllm: request for sample {index} returned no hidden_states_path")
        data = load_hidden_states(path)
        tok = data["token_ids"].to(torch.int64)
        if tok.tolist() != ids:
            raise RuntimeError(f"eyas vllm: states file {path} holds other tokens than sample {index}")
        states = data["hidden_states"][:, order]  # [T, L, H]
        samples.append((index, tok, states))
        cleanup_hidden_states(path)
    write_chunk(
        job["out_dir"],
        name or f"{job['tag']}-{seq:06d}",
        samples,
        meta={"aux": job["aux"], "final": job["final"], "backend": "vllm"},
    )
    return [i for i, _, _ in samples]


def main(job_path: str) -> None:
    guard_engine()
    job = json.loads(Path(job_path).read_text())
    work = Path(job["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(job["prompts"])
    t0 = time.time()
    import vllm
    from vllm import SamplingParams

    model_dir = compat_model_dir(job["model"], work)
    llm, layer_ids = build_llm(job, model_dir)
    log("engine-ready", vllm=vllm.__version__, seconds=round(time.time() - t0, 1))
    if job["backend"] == "vllm-hooks":
        info = llm.collective_rpc("eyas_install", args=(job["aux"], job["final"], job["out_dir"], job["tag"]))
        log("hooks-installed", workers=info)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    done, tokens, t1 = 0, 0, time.time()
    pause_after = int(os.environ.get("EYAS_ENGINE_PAUSE_AFTER_BATCHES", "0"))
    for seq, batch in enumerate(batches(prompts, job.get("batch_tokens", 16384))):
        if job["backend"] == "vllm-hooks":
            written = run_hooks(llm, job, batch, sp)
        else:
            written = run_connector(llm, job, batch, sp, layer_ids, seq)
        done += len(written)
        tokens += sum(len(ids) for _, ids in batch)
        log("batch", samples=done, tokens=tokens, seconds=round(time.time() - t1, 3))
        if seq + 1 == pause_after:  # fault injection for the resume test: hang until killed
            log("paused", batches=seq + 1)
            time.sleep(3600)
    if job["backend"] == "vllm-hooks":
        llm.collective_rpc("eyas_remove")
    log("done", samples=done, tokens=tokens, seconds=round(time.time() - t1, 3))


if __name__ == "__main__":
    main(sys.argv[1])
