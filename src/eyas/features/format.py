"""The hidden-state store's on-disk format: names, dtypes, the shard layout, checksums, fp8.

Layout of a store directory::

    manifest.json                 kind "eyas-store", target identity, layer ids, convention,
                                  dtype (and for fp8 the scale layout), hidden size, prepared-
                                  dataset id; on completion also the sample table (index ->
                                  shard, offset, length) and the shard table
    shard-000007.safetensors      the samples of one shard concatenated along tokens:
                                    input_ids    I64  [N]
                                    hidden_scale F32  [N, A+1, G]      (fp8 stores only)
                                    hidden       <dt> [N, A+1, H]      (slot A = the final state)
                                    loss_mask    BOOL [N]
    shard-000007.json             the shard's commit record: samples, tokens, bytes, checksum
                                  of the whole file, and one checksum per tensor

An fp8 store keeps ``hidden`` as float8 e4m3 (``F8_E4M3``) with one fp32 scale per token, state
and group of ``H / G`` channels (``G = 1`` by default: one scale per token and state); the value
is ``hidden.float() * hidden_scale[..., None]``. Scales are ``amax / 448`` over the group, so the
largest magnitude is e4m3's largest finite value and nothing saturates. The tensors are written in
the order above: each starts at a multiple of its element size, so readers can map them in place.

Everything here is arithmetic on the layout, shared by the writer, the reader, ``--verify`` and
the disk plan, so the bytes the plan announces are the bytes the writer writes.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.extract.config import StoreDtype

KIND = "eyas-store"
# 1: bf16/fp16/fp32 stores; 2: fp8 stores, which add the hidden_scale tensor.
FORMAT_VERSION = 1
FP8_FORMAT_VERSION = 2
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")

# Fields that must agree between a store being resumed and the run resuming it.
CHECKED_FIELDS = (
    "target",
    "aux_layers",
    "final_layer",
    "convention",
    "dtype",
    "scale",
    "hidden_size",
    "prepared_id",
    "num_samples",
    "backend",
    "plan",
)

FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # = ModelDtype's values
FP8 = "fp8"
STORE_DTYPES: tuple[str, ...] = typing.get_args(StoreDtype)  # `eyas extract --dtype`'s values
FP8_TORCH = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_TORCH).max)  # 448
SCALE_TORCH = torch.float32

ST_DTYPE = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    FP8_TORCH: "F8_E4M3",
}
RAW_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.int64: torch.int64,
    torch.bool: torch.uint8,
    FP8_TORCH: torch.uint8,
}


def shard_file(shard_id: int) -> str:
    return f"shard-{shard_id:06d}.safetensors"


def record_file(shard_id: int) -> str:
    return f"shard-{shard_id:06d}.json"


# ------------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class Layout:
    """What one token costs in a store: ``num_slots`` states (aux + final) of ``hidden`` values in
    ``dtype``; for fp8, ``scale_groups`` fp32 scales per state (1 = one per token and state)."""

    dtype: str
    num_slots: int
    hidden: int
    scale_groups: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise EyasError(f"store dtype {self.dtype!r}: use one of {', '.join(STORE_DTYPES)}")
        if self.dtype == FP8:
            g = self.scale_groups
            if g < 1 or self.hidden % g:
                raise EyasError(
                    f"fp8 scale groups {g}: must divide the hidden size {self.hidden} "
                    f"(1 = one scale per token and state; e.g. {self.hidden // 128 or 1} "
                    "for groups of about 128 channels)"
                )
        elif self.scale_groups:
            raise EyasError(f"store dtype {self.dtype}: scale groups are for fp8 stores only")

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8

    @property
    def state_dtype(self) -> torch.dtype:
        return FP8_TORCH if self.quantized else FLOAT_DTYPES[self.dtype]

    @property
    def state_bytes(self) -> int:
        """Bytes of one element of ``hidden``."""
        return torch.empty((), dtype=self.state_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Shard bytes per token, header excluded: ids (8) + states + scales + mask (1)."""
        scales = self.num_slots * self.scale_groups * 4
        return 8 + self.num_slots * self.hidden * self.state_bytes + scales + 1

    def tensors(self, n: int) -> list[tuple[str, str, list[int], int]]:
        """(name, safetensors dtype, shape, bytes) of a shard of ``n`` tokens, in file order."""
        s, h = self.num_slots, self.hidden
        out = [("input_ids", "I64", [n], n * 8)]
        if self.quantized:
            out.append(("hidden_scale", "F32", [n, s, self.scale_groups], n * s * self.scale_groups * 4))
        out.append(("hidden", ST_DTYPE[self.state_dtype], [n, s, h], n * s * h * self.state_bytes))
        out.append(("loss_mask", "BOOL", [n], n))
        return out

    def header(self, n: int) -> bytes:
        """The safetensors header of a shard of ``n`` tokens (length prefix not included)."""
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "eyas": "hidden-state-shard"}}
        off = 0
        for name, dt, shape, size in self.tensors(n):
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
            off += size
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        return hbytes + b" " * (-len(hbytes) % 8)

    def shard_bytes(self, n: int) -> int:
        """The exact size of a shard file of ``n`` tokens."""
        return 8 + len(self.header(n)) + n * self.bytes_per_token

    def manifest_fields(self) -> dict[str, Any]:
        """What the manifest records about the layout (``scale`` is None for float stores)."""
        scale = None
        if self.quantized:
            scale = {
                "format": "float8_e4m3fn",
                "dtype": "float32",
                "tensor": "hidden_scale",
                "groups": self.scale_groups,
                "per": "token and state"
                if self.scale_groups == 1
                else f"token, state and group of {self.hidden // self.scale_groups} channels",
                "rule": f"amax / {FP8_MAX:g}",
            }
        return {
            "dtype": self.dtype,
            "scale": scale,
            "format_version": FP8_FORMAT_VERSION if self.quantized else FORMAT_VERSION,
        }


def check_format(manifest: dict[str, Any], where: str = "store") -> None:
    """Refuse a store whose manifest has no ``scale`` record (None for a float store): a pre-release
    eyas wrote it, without per-tensor checksums."""
    if "scale" not in manifest:
        raise EyasError(
            f"{where}: its manifest has no scale record, so a pre-release eyas wrote it; extract "
            "it again with this eyas (a new --out)"
        )


def layout_of(manifest: dict[str, Any], where: str = "store") -> Layout:
    """The layout a store's manifest describes."""
    dtype = manifest.get("dtype")
    if dtype not in STORE_DTYPES:
        raise EyasError(
            f"{where}: dtype {dtype!r} in its manifest is not one eyas knows "
            f"({', '.join(STORE_DTYPES)}); was it written by a newer eyas?"
        )
    scale = manifest.get("scale")
    groups = 0
    if dtype == FP8:
        if (
            not isinstance(scale, dict)
            or scale.get("format") != "float8_e4m3fn"
            or scale.get("dtype") != "float32"
            or not isinstance(scale.get("groups"), int)
        ):
            raise EyasError(
                f"{where}: an fp8 store whose manifest has no usable scale layout "
                f"(scale = {scale!r}); re-extract it with `eyas extract --dtype fp8`"
            )
        groups = scale["groups"]
    return Layout(dtype, len(manifest["aux_layers"]) + 1, int(manifest["hidden_size"]), groups)


# ------------------------------------------------------------------------------- fp8


def quantize(states: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``states [..., H]`` (any float dtype, any device) -> (e4m3 ``[..., H]``, fp32 ``[..., groups]``).

    The scale of each group is its absolute maximum / 448. A group that is all zeros gets scale 0
    and zeros. A NaN or Inf anywhere in a group makes its scale non-finite, which is how the
    writer's finiteness check sees it.
    """
    x = states.float()
    g = x.unflatten(-1, (groups, x.shape[-1] // groups))
    amax = g.abs().amax(-1, keepdim=True)
    scale = amax / FP8_MAX
    # divide by a positive number in all-zero groups (their values stay 0); clamp only guards
    # rounding at the top of the range, the scale already maps amax to 448
    q = (g / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(FP8_TORCH).flatten(-2), scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 ``[..., H]`` and fp32 ``[..., G]`` scales -> ``[..., H]`` in ``dtype`` (math in fp32)."""
    groups = scale.shape[-1]
    x = q.float().unflatten(-1, (groups, q.shape[-1] // groups)) * scale.float().unsqueeze(-1)
    return x.flatten(-2).to(dtype)


# ------------------------------------------------------------------------------- checksums


def new_hasher() -> tuple[str, Any]:
    """xxh3-64 (GB/s) when the xxhash package is present, else sha256; the name is recorded."""
    try:
        import xxhash

        return "xxh3_64", xxhash.xxh3_64()
    except ImportError:  # pragma: no cover - depends on the machine
        return "sha256", hashlib.sha256()


def hasher_for(name: str) -> Any:
    if name == "sha256":
        return hashlib.sha256()
    if name == "xxh3_64":
        try:
            import xxhash
        except ImportError as e:
            raise EyasError(
                "this store's checksums are xxh3_64: install the 'xxhash' package to verify it (pip install xxhash)"
            ) from e
        return xxhash.xxh3_64()
    raise EyasError(f"unknown checksum algorithm {name!r} in the store; was it written by a newer eyas?")


def file_checksum(path: Path, algo: str) -> str:
    h = hasher_for(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(bytes before the data, parsed header) of a safetensors file."""
    with open(path, "rb") as fh:
        hl = int.from_bytes(fh.read(8), "little")
        return 8 + hl, json.loads(fh.read(hl))


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor without copying (bf16/fp8 have no numpy dtype)."""
    t = t.view(RAW_VIEW[t.dtype]) if t.dtype in RAW_VIEW else t
    return memoryview(t.numpy()).cast("B")
