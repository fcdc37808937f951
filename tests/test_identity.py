"""Target identity from content: the same model written another way keeps its identity; a change
to what the tokenizer or the weights do is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from eyas.errors import EyasError
from eyas.target import IDENTITY_SCHEME, target_identity


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny.make_target(tmp_path_factory.mktemp("id-base"), "llama", num_layers=2, hidden=64)


@pytest.fixture
def copy(base, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".eyas*"))
    return out


def _json(path: Path):
    return json.loads(path.read_text())


def _reversed(obj):
    """The same JSON with every object's keys in reverse order."""
    if isinstance(obj, dict):
        return {k: _reversed(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [_reversed(v) for v in obj]
    return obj


def _rewrite_tokenizer(d: Path) -> None:
    tj = _json(d / "tokenizer.json")
    assert isinstance(tj["model"]["merges"][0], list)  # what this tokenizers writes
    tj["model"]["merges"] = [" ".join(m) for m in tj["model"]["merges"]]  # the older spelling
    tj["added_tokens"] = list(reversed(tj["added_tokens"]))
    (d / "tokenizer.json").write_text(json.dumps(_reversed(tj), indent=4, ensure_ascii=True))
    # the chat template moves from chat_template.jinja into tokenizer_config.json, padded with
    # whitespace; the special tokens are also spelled as in transformers 4.x
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    cfg = _json(d / "tokenizer_config.json")
    added = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj["added_tokens"]}
    cfg.update(
        chat_template="\n  " + template + "\n\n",
        legacy=False,
        added_tokens_decoder=added,
        clean_up_tokenization_spaces=True,
        eos_token={"__type": "AddedToken", "content": cfg["eos_token"], "lstrip": False},
    )
    (d / "special_tokens_map.json").write_text(
        json.dumps({k: cfg[k] for k in ("bos_token", "pad_token", "unk_token")}, indent=1)
    )
    (d / "tokenizer_config.json").write_text(json.dumps(_reversed(cfg), indent=3))


def _rewrite_config(d: Path) -> None:
    cfg = _json(d / "config.json")
    cfg["transformers_version"] = "4.57.6"
    cfg["torch_dtype"] = cfg.pop("dtype")  # 4.x's name
    rope = cfg.pop("rope_parameters")  # 4.x's spelling of the default rope
    assert rope["rope_type"] == "default"
    cfg.update(rope_theta=int(rope["rope_theta"]), rope_scaling=None, output_router_logits=False)
    (d / "config.json").write_text(json.dumps(_reversed(cfg)))


def _reshard(d: Path) -> None:
    """model.safetensors -> two shards (tensors split against their name order) + an index."""
    weights = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(weights)
    parts = {
        "model-00001-of-00002.safetensors": names[len(names) // 2 :],
        "model-00002-of-00002.safetensors": names[: len(names) // 2],
    }
    for i, (fname, keys) in enumerate(parts.items()):
        save_file(
            {k: weights[k] for k in reversed(keys)},
            d / fname,
            metadata={"format": "pt", "shard": str(i), "writer": "another tool"},
        )
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_same_model_written_another_way_keeps_its_identity(base, copy):
    before = target_identity(base)
    assert before["scheme"] == IDENTITY_SCHEME
    _rewrite_tokenizer(copy)
    _rewrite_config(copy)
    _reshard(copy)
    gen = _json(copy / "generation_config.json")
    (copy / "generation_config.json").write_text(json.dumps(dict(gen, transformers_version="4.57.6")))
    assert not (copy / ".eyas-identity.json").exists()
    assert target_identity(copy) == before
    # the rewritten tokenizer still loads and tokenizes the same (the rewrite is a valid one)
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(copy)
    text = "Hello! <|im_start|>user\nwhy is the sky blue?<|im_end|>"
    assert a(text, add_special_tokens=False)["input_ids"] == b(text, add_special_tokens=False)["input_ids"]
    assert a.eos_token == b.eos_token and a.chat_template.strip() == b.chat_template.strip()


def _edit_json(path: Path, fn) -> None:
    data = _json(path)
    fn(data)
    path.write_text(json.dumps(data))


def _swap_merges(tj):
    m = tj["model"]["merges"]
    m[3], m[7] = m[7], m[3]


def _swap_vocab_ids(tj):
    v = tj["model"]["vocab"]
    a, b = [t for t, i in sorted(v.items(), key=lambda kv: kv[1])][100:102]
    v[a], v[b] = v[b], v[a]


def _add_token(tj):
    n = max(tj["model"]["vocab"].values()) + 1
    tj["added_tokens"].append(
        {
            "id": n,
            "content": "<tool>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )


def _unspecial(tj):
    tj["added_tokens"][1]["special"] = False


def _lstrip(tj):
    tj["added_tokens"][2]["lstrip"] = True


def _no_byte_level(tj):
    tj["pre_tokenizer"] = {"type": "Whitespace"}


TOKENIZER_CHANGES = {
    "template": lambda d: (d / "chat_template.jinja").write_text(
        (d / "chat_template.jinja").read_text().replace("assistant", "Assistant")
    ),
    "template-in-config": lambda d: (  # chat_template.jinja wins over it, as in transformers
        (d / "chat_template.jinja").unlink(),
        _edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template="{{ messages[0]['content'] }}")),
    ),
    "merge-order": lambda d: _edit_json(d / "tokenizer.json", _swap_merges),
    "merge-dropped": lambda d: _edit_json(d / "tokenizer.json", lambda t: t["model"]["merges"].pop(5)),
    "vocab-ids": lambda d: _edit_json(d / "tokenizer.json", _swap_vocab_ids),
    "added-token": lambda d: _edit_json(d / "tokenizer.json", _add_token),
    "token-not-special": lambda d: _edit_json(d / "tokenizer.json", _unspecial),
    "token-lstrip": lambda d: _edit_json(d / "tokenizer.json", _lstrip),
    "eos-role": lambda d: _edit_json(d / "tokenizer_config.json", lambda c: c.update(eos_token="<|endoftext|>")),
    "pre-tokenizer": lambda d: _edit_json(d / "tokenizer.json", _no_byte_level),
}


@pytest.mark.parametrize("change", sorted(TOKENIZER_CHANGES))
def test_tokenizer_change_is_refused(base, copy, change):
    before = target_identity(base)
    if change == "template":  # the edit must change something for the test to mean anything
        assert "assistant" in (copy / "chat_template.jinja").read_text()
    TOKENIZER_CHANGES[change](copy)
    after = target_identity(copy)
    assert after["tokenizer"] != before["tokenizer"] and after["id"] != before["id"]
    assert after["weights"] == before["weights"] and after["config"] == before["config"]


def _edit_weights(d: Path, fn) -> str:
    weights = load_file(d / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name] = fn(weights[name].clone())
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return name


def _bump(flat_index):
    def fn(t):
        flat = t.view(-1)
        flat[flat_index(flat.numel())] += 0.5
        return t

    return fn


WEIGHT_CHANGES = {
    "first-element": _bump(lambda n: 0),
    "last-element": _bump(lambda n: n - 1),
    "middle-sample": _bump(lambda n: (n - 1) * 7 // 15),  # one of the fixed sample positions
    "shape": lambda t: t.reshape(1, -1),  # same bytes, another shape
    "dtype": lambda t: t.view(torch.int32),  # same bytes, another dtype
    "cast": lambda t: t.to(torch.bfloat16),
}


@pytest.mark.parametrize("change", sorted(WEIGHT_CHANGES))
def test_weight_change_is_refused(base, copy, change):
    before = target_identity(base)
    _edit_weights(copy, WEIGHT_CHANGES[change])
    after = target_identity(copy)
    assert after["weights"] != before["weights"] and after["id"] != before["id"]
    assert after["tokenizer"] == before["tokenizer"]


def test_config_change_is_refused(base, copy):
    before = target_identity(base)
    _edit_json(copy / "config.json", lambda c: c.update(rms_norm_eps=1e-5))
    assert target_identity(copy)["config"] != before["config"]

    def linear_rope(c):  # a non-default rope is not folded into rope_parameters: refused, not guessed
        c.update(
            rms_norm_eps=1e-6,
            rope_theta=c.pop("rope_parameters")["rope_theta"],
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        )

    _edit_json(copy / "config.json", linear_rope)
    assert target_identity(copy)["config"] != before["config"]


def test_old_cache_is_not_served(base, copy):
    real = target_identity(copy)
    cache = copy / ".eyas-identity.json"
    cached = _json(cache)
    assert cached["scheme"] == IDENTITY_SCHEME
    old = {"id": "0" * 16, "config": "1" * 16, "weights": "2" * 16, "tokenizer": "3" * 16}
    cache.write_text(json.dumps({"stamp": cached["stamp"], "identity": old}))  # scheme 1's layout
    assert target_identity(copy) == real
    cache.write_text(json.dumps({"scheme": IDENTITY_SCHEME, "stamp": cached["stamp"], "identity": old}))
    assert target_identity(copy) == old  # the cache is trusted while the files' stamp holds


def test_sentencepiece_only_tokenizer_hashes_its_bytes(copy):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (copy / name).unlink()
    with pytest.raises(EyasError, match="no tokenizer files"):
        target_identity(copy)
    blob = np.random.default_rng(0).bytes(4096)
    (copy / "tokenizer.model").write_bytes(blob)
    first = target_identity(copy)["tokenizer"]
    (copy / "tokenizer.model").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert target_identity(copy)["tokenizer"] != first


def test_dataset_of_an_older_identity_asks_for_prepare(tmp_path, tiny_target):
    from eyas.data.dataset import open_prepared, write_prepared
    from eyas.data.vocab import build_draft_vocab

    vocab = tiny_target.config()["vocab_size"]
    d2t, t2d, _ = build_draft_vocab(np.zeros(vocab, np.int64), 8)
    out = write_prepared(tmp_path / "ds", [[1, 2, 3]], [[0, 1, 1]], ["a:0"], tiny_target, d2t, t2d)
    m = _json(out / "manifest.json")
    m["target"] = {"id": "c09b" * 4, "config": "a" * 16, "weights": "b" * 16, "tokenizer": "c" * 16}
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EyasError, match=r"older eyas.*Re-run `eyas prepare` with this target"):
        open_prepared(out, tiny_target)


def test_gguf_conversion_takes_specials_from_metadata(tmp_path):
    """The GGUF's own special-token ids decide bos/eos/unk/pad (transformers versions guessed
    differently), and a conversion cached by an older eyas is redone."""
    import gguf

    from eyas.target import CONVERSION, _converted, _gguf_special_tokens

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(999)  # not in the vocabulary: left to transformers
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = tiny.make_tokenizer(tmp_path / "tok")
    assert _gguf_special_tokens(path, tok) == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
    }
    out = tmp_path / "conv"
    out.mkdir()
    (out / ".eyas-complete").write_text("ok\n")
    (out / ".eyas-source.json").write_text(json.dumps({"gguf": str(path), "sha256": "x"}))
    assert not _converted(out)  # made before conversion 2: converted again
    (out / ".eyas-source.json").write_text(json.dumps({"gguf": str(path), "conversion": CONVERSION}))
    assert _converted(out)
