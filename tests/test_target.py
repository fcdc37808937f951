"""Target resolution and identity."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.errors import EyasError
from eyas.target import BUILTIN_TARGETS, resolve_target, target_identity


def test_hf_dir_resolves_with_stable_identity(tiny_llama_dir):
    a = resolve_target(tiny_llama_dir)
    b = resolve_target(str(tiny_llama_dir))
    assert a.path == Path(tiny_llama_dir).resolve()
    assert a.identity == b.identity
    assert set(a.identity) == {"scheme", "id", "config", "weights", "tokenizer"}
    assert a.config()["num_hidden_layers"] == 8


def test_identity_tracks_weights_and_tokenizer(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    base = target_identity(tiny_llama_dir)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy, ignore=shutil.ignore_patterns(".eyas*"))
    assert target_identity(copy) == base  # same files, same identity

    weights = load_file(copy / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1.0
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    changed = target_identity(copy)
    assert changed["weights"] != base["weights"] and changed["id"] != base["id"]
    assert changed["tokenizer"] == base["tokenizer"]

    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    assert target_identity(copy)["tokenizer"] != base["tokenizer"]


def test_bad_targets_are_named(tmp_path):
    with pytest.raises(EyasError, match="built-in names"):
        resolve_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="no config.json"):
        resolve_target(tmp_path / "empty")


def test_doctor_lists_backends():
    out = subprocess.run([sys.executable, "-m", "eyas.cli", "doctor", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    names = {b["name"]: b for b in info["backends"]}
    assert names["hf"]["usable"] is True
    assert {"vllm", "vllm-hooks"} <= set(names)
    assert all(b["reason"] for b in info["backends"])


@pytest.mark.slow
def test_builtin_sha_mismatch_keeps_nothing(monkeypatch, tmp_path):
    import eyas.target as target_mod

    bad = dict(BUILTIN_TARGETS["smollm2-135m-instruct"], sha256="0" * 64)
    monkeypatch.setitem(target_mod.BUILTIN_TARGETS, "smollm2-135m-instruct", bad)
    with pytest.raises(EyasError, match="sha256"):
        resolve_target("smollm2-135m-instruct", cache=tmp_path)
    assert not list((tmp_path / "gguf").glob("*.gguf"))
    assert not (tmp_path / "targets" / "smollm2-135m-instruct").exists()


@pytest.mark.slow
def test_builtin_smollm2_converts_once(monkeypatch):
    # Uses the real user cache (as the pipeline does), so CI converts the model only once.
    monkeypatch.delenv("EYAS_CACHE")
    t = resolve_target("smollm2-135m-instruct")
    cfg = t.config()
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    weights = t.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = resolve_target("smollm2-135m-instruct")
    assert again.identity == t.identity
    assert weights.stat().st_mtime_ns == stamp  # reused, not converted again
    tok = t.load_tokenizer()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
