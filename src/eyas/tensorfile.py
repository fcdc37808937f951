"""A safetensors file's header read without trusting it: what a tensor file claims is checked
against the file before anything is allocated or mapped (a header length of terabytes, offsets
past the end, overlapping tensors, a size that does not fit the shape: each would otherwise be a
reader's traceback, or an allocation that takes the machine)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

# bytes per element of every safetensors dtype (F4/F6 packed types are not written by eyas)
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def tensor_shapes(path: str | Path, what: str, fix: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors file ``path``, after checking the header against the
    file. ``what`` names the file's role in errors ("draft checkpoint"), ``fix`` says what to do."""
    path = Path(path)

    def bad(why: str) -> EyasError:
        return EyasError(f"{what} {path}: {why}; it is cut off, damaged or not a safetensors file. {fix}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise bad(f"its header claims {n:,} bytes, the file holds {size - 8:,} after the length")
            raw = fh.read(n)
    except OSError as e:
        raise EyasError(f"{what} {path}: cannot be read ({e.strerror}). {fix}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"its header is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = size - 8 - n
    spans, shapes = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            a, b = int(a), int(b)
        except (TypeError, KeyError, ValueError):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if dtype not in DTYPE_BYTES:
            raise bad(f"tensor {name!r} has dtype {dtype!r}, which eyas does not read")
        if any(d < 0 for d in shape):
            raise bad(f"tensor {name!r} has a negative dimension in {shape}")
        if not 0 <= a <= b <= data:
            raise bad(f"tensor {name!r} spans bytes {a:,}..{b:,} of a {data:,}-byte data section")
        if b - a != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise bad(
                f"tensor {name!r} ({dtype} {shape}) needs {math.prod(shape) * DTYPE_BYTES[dtype]:,} bytes, "
                f"its offsets give {b - a:,}"
            )
        spans.append((a, b, name))
        shapes[name] = tuple(shape)
    spans.sort()
    for (_, b0, n0), (a1, _, n1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise bad(f"tensors {n0!r} and {n1!r} overlap")
    return shapes


def load_tensors(path: str | Path, what: str, fix: str) -> dict[str, Any]:
    """``safetensors.torch.load_file`` after :func:`tensor_shapes` has checked the header; a read
    that still fails is an EyasError naming the file."""
    from safetensors.torch import load_file

    tensor_shapes(path, what, fix)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise EyasError(f"{what} {path}: unreadable ({type(e).__name__}: {first}). {fix}") from None
