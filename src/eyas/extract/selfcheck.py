"""The self-check before a long extraction with a vLLM backend on an untested vLLM version.

``eyas extract`` with ``--backend vllm`` / ``vllm-hooks`` (or ``auto`` choosing one) on a vLLM
version the compatibility matrix has not passed (eyas.extract.backends.vllm_tested) first
extracts the first ``--self-check N`` samples still to do twice, with that vLLM backend and with
``--backend hf``, each into a small fp32 store beside ``--out``, and compares them with
:func:`eyas.features.compare.compare_stores`. A mismatch stops the run before anything is stored
in ``--out``, with the figures; the two small stores are kept for ``eyas extract --verify``.

The rule (:func:`verdict`), per slot (each aux layer and the final state):

- mean cosine >= 0.999, and
- at most 0.1% of tokens below cosine 0.99 (the 0.1st percentile is >= 0.99).

Why not the minimum: in bf16 the two backends round differently and a few isolated tokens drift.
On an H200 (SmolLM2, bf16, vLLM 0.26 vs HF, 4.5M tokens, benchmarks/gpu_job/parity.json) the
mean cosine was >= 0.9998 in every slot but the worst tokens reached 0.976; at most 30 tokens
of the 4.5M per slot (7e-6) were below 0.99. A real fault moves far more than 0.1% of the tokens: a layer one
off, pre- instead of post-norm, states of another sample (batching), wrong RoPE, or one whole
sample of the few checked (then its share of the tokens, which for 8 samples is far above
0.1%). vLLM 0.12's wrong Qwen3 states (min 0.76, most tokens about 0.8-0.88) fail both parts.
The hf side runs in fp32 when the target fits so, else in the run's compute dtype, so that
hf's own rounding does not add to vLLM's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from eyas.device import release_device_memory
from eyas.errors import EyasError

MEAN_COSINE = 0.999
TAIL_COSINE = 0.99
TAIL_FRACTION = 0.001  # of a slot's tokens allowed below TAIL_COSINE
DEFAULT_SAMPLES = 8  # --self-check default: a few samples, one engine batch
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def verdict(report: dict[str, Any]) -> list[str]:
    """What fails the rule above in a compare_stores report made with min_cosine=TAIL_COSINE;
    empty when the states agree."""
    if report["min_cosine_required"] != TAIL_COSINE:
        raise ValueError(f"verdict needs a report made with min_cosine={TAIL_COSINE}")
    tokens = max(int(report["tokens"]), 1)
    bad = []
    for sl in report["slots"]:
        share = sl["tokens_below"] / tokens
        if sl["mean_cosine"] < MEAN_COSINE or share > TAIL_FRACTION:
            bad.append(
                f"{sl['slot']}: mean cosine {sl['mean_cosine']:.5f} (needs >= {MEAN_COSINE}), "
                f"{sl['tokens_below']} of {tokens} tokens ({share:.2%}) below {TAIL_COSINE} "
                f"(allowed {TAIL_FRACTION:.1%}), worst {sl['min_cosine']:.4f} at sample "
                f"{sl['worst_sample']} token {sl['worst_token']}"
            )
    return bad


def weight_numel(model_dir: Path) -> int | None:
    """Parameters in the target's safetensors files (headers only); None when there are none."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                total += int(np.prod(h.get_slice(k).get_shape(), dtype=np.int64))
    return total


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def hf_dtype(model_dir: Path, device: str, run_dtype: str | None) -> tuple[str | None, str]:
    """The dtype the hf side of the check runs in (fp32 where it fits, else the run's), or None
    with the reason when the target does not fit on ``device`` at all."""
    numel = weight_numel(model_dir)
    if numel is None:
        return "fp32", "no safetensors to size the target by; trying fp32"
    free = free_bytes(device)
    fallback = run_dtype if run_dtype in BYTES and run_dtype != "fp32" else "bf16"
    for name in ("fp32", fallback):
        need = int(numel * BYTES[name] * 1.2)  # 20% for activations of a few samples and the allocator
        if need <= free:
            return name, (
                f"{numel / 1e6:,.1f}M parameters in {name} need ~{need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free"
            )
    return None, (
        f"the target ({numel / 1e6:,.0f}M parameters) needs ~{numel * BYTES[fallback] * 1.2 / 2**30:.1f} "
        f"GiB in {fallback}, {device} has {free / 2**30:.1f} GiB free"
    )


def subset(ds, indices: list[int], target, out: Path) -> Path:
    """A prepared dataset of just ``indices`` of ``ds`` (same tokens, masks and draft vocab)."""
    from eyas.data.dataset import write_prepared

    rows = [ds[i] for i in indices]
    d2t, t2d = ds.draft_vocab()
    extra = {
        "chat_template_sha256": ds.manifest.get("chat_template_sha256"),
        "self_check_of": str(ds.path),
        "self_check_indices": list(indices),
    }
    return write_prepared(
        out,
        [r.input_ids.tolist() for r in rows],
        [r.loss_mask.astype(int).tolist() for r in rows],
        [r.source_id for r in rows],
        target,
        d2t,
        t2d,
        extra_manifest=extra,
    )


def self_check(
    target_spec: str,
    target,
    ds,
    todo: list[int],
    n: int,
    backend: str,
    out: Path,
    aux_layers: list[int],
    device: str,
    model_dtype: str | None,
    vllm_python: str | None,
    tensor_parallel_size: int,
    why: str,
) -> dict[str, Any] | None:
    """Run the check (see the module doc); returns its summary, None when skipped; raises
    EyasError with the figures when the vLLM backend's states differ from hf's."""
    from eyas.features.compare import compare_stores
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract

    say = lambda msg: print(f"eyas extract: self-check: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    indices = todo[:n]
    if not indices:
        return None
    dtype, sized = hf_dtype(target.path, device, model_dtype)
    if dtype is None:
        say(
            f"skipped: {sized}, so hf cannot be run beside it here. Check by hand on a larger "
            f"device: extract a few samples with --backend hf and with --backend {backend}, then "
            "`eyas extract --verify STORE --against HF_STORE`; --self-check 0 silences this"
        )
        return {"ran": False, "reason": sized}
    work = out.parent / f".{out.name}.self-check"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    say(
        f"{why}; extracting samples {indices[:5]}{'...' if len(indices) > 5 else ''} ({len(indices)}) "
        f"with {backend} and with hf ({dtype}; {sized}) into {work}"
    )
    data = subset(ds, indices, target, work / "data")
    common = dict(
        target=target_spec,
        data=data,
        layers=list(aux_layers),
        dtype="fp32",
        device=device,
        progress=False,
        self_check=0,
    )
    try:
        extract(
            ExtractConfig(
                out=work / backend,
                backend=backend,
                model_dtype=model_dtype,
                vllm_python=vllm_python,
                tensor_parallel_size=tensor_parallel_size,
                **common,
            )
        )
    except EyasError as e:
        raise EyasError(
            f"self-check: {backend} failed on the first {len(indices)} samples, before any comparison ({why}): {e}"
        ) from e
    extract(ExtractConfig(out=work / "hf", backend="hf", model_dtype=dtype, **common))
    release_device_memory()  # the hf model goes before the real run's vLLM engine asks for device memory
    rep = compare_stores(work / backend, work / "hf", TAIL_COSINE, device=device, progress=False)
    bad = verdict(rep)
    worst = min(sl["mean_cosine"] for sl in rep["slots"])
    summary = {
        "ran": True,
        "ok": not bad,
        "samples": rep["samples"],
        "tokens": rep["tokens"],
        "lowest_mean_cosine": worst,
        "min_cosine": min(sl["min_cosine"] for sl in rep["slots"]),
        "slots": rep["slots"],
        "hf_dtype": dtype,
    }
    if bad:
        raise EyasError(
            f"self-check failed: {backend}'s states for the first {rep['samples']} samples differ from "
            "--backend hf's:\n  " + "\n  ".join(bad) + f"\n({why}.) Nothing was extracted into {out}. Both "
            f"stores are kept: `eyas extract --verify {work / backend} --against {work / 'hf'}` lists every "
            "sample. Use --backend hf, a tested vLLM version, or --self-check 0 to extract anyway"
        )
    say(
        f"passed: {rep['samples']} samples, {rep['tokens']} tokens, lowest mean cosine {worst:.6f}, "
        f"min {summary['min_cosine']:.5f}"
    )
    shutil.rmtree(work, ignore_errors=True)
    return summary
