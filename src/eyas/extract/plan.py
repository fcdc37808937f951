"""What an `eyas extract` run will write and roughly how long it will take, before it starts.

The bytes are exact arithmetic on the store layout (:class:`eyas.features.format.Layout`: the
writer uses the same functions), over the batch plan the HF backend follows (batch k = shard k).
Metadata (shard records, the manifest with its sample table) is estimated generously. The time
is an estimate, and says so: a throughput measured for one model on one device class, scaled by
the target's parameters used per token.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eyas.errors import EyasError
from eyas.features.format import FP8, Layout

# A test seam: pretend the filesystem of --out has this many bytes free (the arithmetic stays the
# real one). Lets tests drive the refusal without filling a disk.
FREE_BYTES_ENV = "EYAS_FREE_BYTES"

# Measured `eyas extract` throughput (HF backend) of SmolLM2-135M-Instruct, benchmarks/extract_results.md.
# The conservative figure of each: the H200's first run in its process (run 2, 1st), the CPU box's
# run 5. REFERENCE_PARAMS is SmolLM2's parameters used per token counted as count_active_params()
# counts them (decoder layers and final norm; no embedding, no lm_head: extraction runs neither).
REFERENCE_RATES = {
    "cuda": (458_347.0, "SmolLM2-135M HF extraction on one H200"),
    "cpu": (129.0, "SmolLM2-135M HF extraction on the project's 2-core CPU box"),
}
REFERENCE_PARAMS = 106_203_456
REFERENCE_SOURCE = "benchmarks/extract_results.md"

# Generous metadata estimate: a shard record (~0.5 KiB + ~30 B per sample) and the manifest's shard
# and sample tables (~0.3 KiB per shard, ~40 B per sample), the manifest counted twice because it
# is replaced through a temporary copy.
_META_PER_SHARD = 2048
_META_PER_SAMPLE = 160
_META_FIXED = 1 << 16

_EXPERT = re.compile(r"\.experts\.")
_SKIP = re.compile(r"(embed_tokens|lm_head|rotary|vision|visual|mm_projector|multi_modal_projector)")
_QUANT_META = re.compile(r"(weight_scale|weight_shape|weight_zero_point|weight_global_scale|g_idx)$")


@dataclass
class ExtractPlan:
    out: Path
    layout: Layout
    samples: int
    samples_todo: int
    tokens: int
    tokens_todo: int
    shards_todo: int
    shard_bytes_todo: int  # exact: the shard files this run writes
    meta_bytes: int  # estimate: records + manifest
    free_bytes: int | None = None
    free_where: str = ""
    tokens_per_s: float | None = None  # estimate
    rate_note: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_todo(self) -> int:
        return self.shard_bytes_todo + self.meta_bytes

    @property
    def seconds(self) -> float | None:
        return self.tokens_todo / self.tokens_per_s if self.tokens_per_s else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "dtype": self.layout.dtype,
            "bytes_per_token": self.layout.bytes_per_token,
            "samples": self.samples,
            "samples_todo": self.samples_todo,
            "tokens": self.tokens,
            "tokens_todo": self.tokens_todo,
            "shards_todo": self.shards_todo,
            "shard_bytes_todo": self.shard_bytes_todo,
            "meta_bytes": self.meta_bytes,
            "bytes_todo": self.bytes_todo,
            "free_bytes": self.free_bytes,
            "tokens_per_s_estimate": self.tokens_per_s,
            "seconds_estimate": self.seconds,
        }

    def lines(self) -> list[str]:
        lay = self.layout
        per = (
            f"{lay.num_slots} states x H={lay.hidden} x {lay.state_bytes} B ({lay.dtype})"
            + (f" + {lay.num_slots * lay.scale_groups} fp32 scale(s)" if lay.quantized else "")
            + " + 8 B id + 1 B mask"
        )
        done = self.samples - self.samples_todo
        out = [
            f"plan for {self.out}: {self.samples:,} samples, {self.tokens:,} tokens"
            + (
                f"; {done:,} samples already stored, {self.samples_todo:,} samples / "
                f"{self.tokens_todo:,} tokens to extract"
                if done
                else ""
            ),
            f"  per token: {lay.bytes_per_token:,} B = {per}; per 10M tokens: {gb(lay.bytes_per_token * 10_000_000)}",
            f"  to write: {gb(self.bytes_todo)} ({self.shards_todo:,} shards: {gb(self.shard_bytes_todo)}; "
            f"records and manifest: about {gb(self.meta_bytes)})",
        ]
        if self.free_bytes is not None:
            out.append(f"  free at {self.free_where}: {gb(self.free_bytes)}")
        if self.tokens_per_s:
            out.append(
                f"  time (estimate): {duration(self.seconds or 0.0)} at about "
                f"{self.tokens_per_s:,.0f} tokens/s; {self.rate_note}"
            )
        else:
            out.append(f"  time: no estimate ({self.rate_note})")
        out += [f"  note: {n}" for n in self.notes]
        return out

    def check_space(self) -> None:
        """Refuse before any work when the store will not fit (instead of ENOSPC halfway)."""
        if self.free_bytes is None or self.bytes_todo <= self.free_bytes:
            return
        fp8 = ""
        if self.layout.dtype != FP8:
            half = Layout(FP8, self.layout.num_slots, self.layout.hidden, 1)
            fp8 = (
                f", or --dtype fp8 ({half.bytes_per_token:,} B/token: about "
                f"{gb(self.meta_bytes + self.tokens_todo * half.bytes_per_token)})"
            )
        raise EyasError(
            f"--out {self.out}: this extraction writes {gb(self.bytes_todo)} "
            f"({self.tokens_todo:,} tokens x {self.layout.bytes_per_token:,} B + metadata), "
            f"but only {gb(self.free_bytes)} are free at {self.free_where}. Nothing was "
            "written. Free space there, pass an --out on a larger filesystem, extract "
            f"fewer samples (eyas prepare --max-samples){fp8}. `eyas extract --plan` "
            "prints this plan without running"
        )


def plan_meta_bytes(shards: int, samples: int) -> int:
    """Generous estimate of the metadata a run writes beside its shards."""
    return _META_FIXED + shards * _META_PER_SHARD + samples * _META_PER_SAMPLE


def gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e7 else f"{n / 1e6:,.3f} MB"


def duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def free_space(out: Path) -> tuple[int, str]:
    """Free bytes on the filesystem that will hold ``out`` (its nearest existing ancestor)."""
    if os.environ.get(FREE_BYTES_ENV):
        raw = os.environ[FREE_BYTES_ENV]
        try:
            return int(raw), f"{out} (${FREE_BYTES_ENV})"
        except ValueError as e:
            raise EyasError(f"${FREE_BYTES_ENV}={raw!r}: expected a number of bytes") from e
    p = Path(out).resolve()
    while not p.exists():
        p = p.parent
    return int(shutil.disk_usage(p).free), str(p)


def shard_tokens(lengths: np.ndarray, batches: list[list[int]], todo: set[int]) -> list[int]:
    """Tokens of each shard a run writes: batch k of the plan, less its stored samples, is shard k."""
    out = []
    for batch in batches:
        n = int(sum(int(lengths[i]) for i in batch if i in todo))
        if n:
            out.append(n)
    return out


def count_active_params(model_dir: Path, config: dict[str, Any]) -> tuple[int | None, str]:
    """Parameters one token runs through in the decoder, from the safetensors headers (no weights
    are read): embeddings, lm_head and vision towers left out; expert tensors (``.experts.``)
    counted at num_experts_per_tok / num_experts; packed int4 weights (compressed-tensors
    ``weight_packed``) counted unpacked."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None, f"no *.safetensors in {model_dir} to count parameters from"
    text = config.get("text_config", config)
    experts = next((text[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if text.get(k)), None)
    top_k = text.get("num_experts_per_tok") or text.get("moe_topk")
    share = (float(top_k) / float(experts)) if experts and top_k else 1.0
    bits = _packed_bits(config)
    total = 0.0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, spec in header.items():
            if name == "__metadata__" or _SKIP.search(name) or _QUANT_META.search(name):
                continue
            n = math.prod(spec["shape"])
            if name.endswith("weight_packed"):
                n *= {"I32": 32, "I8": 8, "U8": 8}.get(spec["dtype"], 8) // bits
            total += n * (share if _EXPERT.search(name) else 1.0)
    note = f"MoE: experts counted at {top_k}/{experts}" if share != 1.0 else ""
    return int(total), note


def _millions(n: float) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def _packed_bits(config: dict[str, Any]) -> int:
    q = config.get("quantization_config") or {}
    for group in (q.get("config_groups") or {}).values():
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return 4


def rate_estimate(
    target_dir: Path, config: dict[str, Any], device: str, backend: str, gpus: int
) -> tuple[float | None, str]:
    """Tokens/s to expect, scaled from the reference measurement by parameters per token and GPUs."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    ref, what = REFERENCE_RATES[kind]
    params, note = count_active_params(target_dir, config)
    if not params:
        return None, note
    n = gpus if kind == "cuda" and backend != "hf" else 1
    rate = ref * REFERENCE_PARAMS / params * n
    how = (
        f"scaled from {what} ({ref:,.0f} tokens/s, {REFERENCE_SOURCE}) by parameters per token "
        f"({_millions(REFERENCE_PARAMS)} there, {_millions(params)} here"
        + (f"; {note}" if note else "")
        + ")"
        + (f" x {n} GPUs, assuming linear scaling" if n > 1 else "")
        + "; the disk, vLLM's own speed and attention over long samples are not modelled"
    )
    return rate, how
