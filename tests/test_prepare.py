"""`eyas prepare` end to end on a tiny target: counts, masks, vocab, resume, refusals, CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

import tiny
from eyas.data import prepare as prep
from eyas.data.dataset import open_prepared
from eyas.data.prepare import PrepareOptions, prepare
from eyas.data.vocab import draft_to_target_ids
from eyas.errors import EyasError

WORDS = [
    "the quick brown fox",
    "capital of France",
    "numbers 1 2 3",
    "Hello! How can I help",
    "def add(a, b): return a + b",
    "blue sky",
    "lazy dog jumps",
    "Paris. Berlin.",
]


def _conv(i, turns=2):
    msgs = []
    for t in range(turns):
        msgs.append({"from": "human", "value": f"question {i}.{t}: {WORDS[(i + t) % 8]}?"})
        msgs.append({"from": "gpt", "value": f"answer {i}.{t}: {WORDS[(i * 3 + t) % 8]}."})
    return {"id": f"c{i}", "conversations": msgs}


def _data(tmp_path, n=14):
    good = [_conv(i, turns=1 + i % 3) for i in range(n)]
    bad = [
        "{not json",
        json.dumps({"conversations": [{"from": "gpt", "value": "me first"}, {"from": "human", "value": "x"}]}),
        json.dumps({"messages": [{"role": "alien", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}),
    ]
    lines = [json.dumps(g) for g in good[:5]] + bad + [json.dumps(g) for g in good[5:]]
    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f, good


def _opts(out, target, data, **kw):
    base = dict(
        out=out,
        target=str(target.path),
        data=[str(data)],
        draft_vocab_size=40,
        max_length=256,
        workers=1,
        chunk_size=4,
        progress=False,
    )
    base.update(kw)
    return PrepareOptions(**base)


def test_prepare_counts_masks_and_vocab(tmp_path, tiny_target):
    data, good = _data(tmp_path)
    m = prepare(_opts(tmp_path / "out", tiny_target, data), log=lambda s: None)
    c = m["counts"]
    assert c["read"] == 18 and c["samples"] == 14 and c["dropped_total"] == 4
    assert c["dropped"] == {"malformed_json": 1, "starts_with_assistant": 1, "unknown_role": 1, "empty_content": 1}
    assert m["skip_examples"]["malformed_json"][0].startswith(f"{data}:6")
    assert m["settings"]["target"] == tiny_target.identity and m["max_length"] == 256
    assert m["sources"][0]["records"] == 18 and m["mask_method"] == "prefix_renders"

    ds = open_prepared(tmp_path / "out", tiny_target)
    tok = tiny_target.load_tokenizer()
    assert len(ds) == 14
    assert [s.source_id for s in ds] == [f"chats:{i if i < 5 else i + 4}:c{i}" for i in range(14)]
    for s, g in zip(ds, good):
        # the trained-on tokens decode to exactly the answers, each closed by <|im_end|>
        runs = np.split(np.arange(len(s.input_ids)), np.nonzero(np.diff(s.loss_mask))[0] + 1)
        answers = [tok.decode(s.input_ids[r]) for r in runs if s.loss_mask[r[0]]]
        assert answers == [t["value"] + "<|im_end|>" for t in g["conversations"] if t["from"] == "gpt"]
    assert c["trained_tokens"] == int(sum(s.loss_mask.sum() for s in ds))

    # draft vocab: the 40 most frequent trained-on ids (ties by id), counted here independently
    vocab = tiny_target.config()["vocab_size"]
    counts = np.zeros(vocab, np.int64)
    for s in ds:
        np.add.at(counts, s.input_ids[s.loss_mask], 1)
    expect = sorted(sorted(range(vocab), key=lambda t: (-counts[t], t))[:40])
    d2t, t2d = ds.draft_vocab()
    assert d2t.shape == (40,) and t2d.shape == (vocab,)
    assert draft_to_target_ids(d2t).tolist() == expect
    assert torch.nonzero(t2d).flatten().tolist() == expect
    assert m["coverage"] == pytest.approx(counts[expect].sum() / counts.sum())


def test_truncation_and_no_trained_tokens(tmp_path, tiny_target):
    long_q = "the quick brown fox " * 40
    rows = [{"prompt": long_q, "response": "short answer"}, {"prompt": "hi", "response": long_q}]
    f = tmp_path / "pr.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    m = prepare(_opts(tmp_path / "out", tiny_target, f, max_length=32), log=lambda s: None)
    assert m["counts"]["dropped"] == {"no_trained_tokens": 1}
    assert m["counts"]["samples"] == 1 and m["counts"]["truncated_samples"] == 1
    ds = open_prepared(tmp_path / "out")
    assert ds.lengths.tolist() == [32] and ds[0].loss_mask[-1]


def test_strict_turns_skips_into_errors(tmp_path, tiny_target):
    data, _ = _data(tmp_path)
    with pytest.raises(EyasError, match=rf"--strict: {data}:6: malformed_json"):
        prepare(_opts(tmp_path / "out", tiny_target, data, strict=True), log=lambda s: None)


def test_resume_after_crash_matches_clean_run(tmp_path, tiny_target, monkeypatch):
    data, _ = _data(tmp_path)
    clean = prepare(_opts(tmp_path / "clean", tiny_target, data), log=lambda s: None)

    from eyas.data import dataset  # prepare() looks write_shard up here at call time

    calls = {"n": 0}
    orig = dataset.write_shard

    def crashing(path, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # like ^C while the third shard is being written
        return orig(path, *a, **kw)

    monkeypatch.setattr(dataset, "write_shard", crashing)
    with pytest.raises(KeyboardInterrupt):
        prepare(_opts(tmp_path / "out", tiny_target, data), log=lambda s: None)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "out").glob("shard-*")) == ["shard-00000.parquet", "shard-00001.parquet"]
    monkeypatch.setattr(dataset, "write_shard", orig)
    encoded = []
    real_encode = prep._encode_chunk
    monkeypatch.setattr(prep, "_encode_chunk", lambda items, *a: encoded.append(len(items)) or real_encode(items, *a))
    logs = []
    resumed = prepare(_opts(tmp_path / "out", tiny_target, data), log=logs.append)
    assert any("resuming" in s for s in logs)
    assert len(encoded) == 3  # 5 chunks of 4 records (18 records): 2 were done before the crash
    assert resumed["counts"] == clean["counts"] and resumed["coverage"] == clean["coverage"]
    a, b = open_prepared(tmp_path / "clean"), open_prepared(tmp_path / "out")
    assert [s.source_id for s in a] == [s.source_id for s in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)


def test_rerun_refuses_other_settings_and_targets(tmp_path, tiny_target, tiny_llama_dir):
    data, _ = _data(tmp_path)
    out = tmp_path / "out"
    prepare(_opts(out, tiny_target, data), log=lambda s: None)
    logs = []
    prepare(_opts(out, tiny_target, data), log=logs.append)
    assert "nothing to do" in logs[0]
    with pytest.raises(EyasError, match="max_length: 256 there, 128 now"):
        prepare(_opts(out, tiny_target, data, max_length=128), log=lambda s: None)
    data.write_text(data.read_text().replace("question 3.0", "question three"))  # edited input
    with pytest.raises(EyasError, match="data_sha256"):
        prepare(_opts(out, tiny_target, data), log=lambda s: None)
    other_dir = tiny.make_target(tmp_path / "other", "qwen2", num_layers=2, seed=1)
    from eyas.target import resolve_target

    other = resolve_target(other_dir)
    with pytest.raises(EyasError, match="target"):
        prepare(_opts(out, other, data), log=lambda s: None)
    with pytest.raises(EyasError, match="another target"):
        open_prepared(out, other)
    # an unfinished run with other settings is refused too, naming the field
    (out / "manifest.json").unlink()
    (out / prep.STATE_FILE).write_text(json.dumps({"max_length": 999}))
    with pytest.raises(EyasError, match="unfinished prepare"):
        prepare(_opts(out, tiny_target, data), log=lambda s: None)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match="not an eyas prepare output"):
        prepare(_opts(junk, tiny_target, data), log=lambda s: None)


def test_worker_pool_gives_identical_output(tmp_path, tiny_target):
    data, _ = _data(tmp_path, n=30)
    prepare(_opts(tmp_path / "one", tiny_target, data, max_samples=25), log=lambda s: None)
    m = prepare(_opts(tmp_path / "two", tiny_target, data, max_samples=25, workers=2), log=lambda s: None)
    assert m["counts"]["read"] == 25
    a, b = open_prepared(tmp_path / "one"), open_prepared(tmp_path / "two")
    assert len(a) == len(b) == 21
    for x, y in zip(a, b):
        assert x.source_id == y.source_id
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)


def test_target_without_template_and_chat_template_file(tmp_path, tiny_target):
    no_tpl = tmp_path / "notpl"
    shutil.copytree(tiny_target.path, no_tpl)
    cfg = json.loads((no_tpl / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_tpl / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in no_tpl.glob("chat_template*"):
        f.unlink()
    (no_tpl / ".eyas-identity.json").unlink(missing_ok=True)
    from eyas.target import resolve_target

    t = resolve_target(no_tpl)
    assert not t.load_tokenizer().chat_template
    data, _ = _data(tmp_path)
    with pytest.raises(EyasError, match="--chat-template"):
        prepare(_opts(tmp_path / "a", t, data), log=lambda s: None)
    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(tiny.CHATML)
    m = prepare(_opts(tmp_path / "b", t, data, chat_template=tpl), log=lambda s: None)
    assert m["counts"]["samples"] == 14 and m["chat_template_source"] == str(tpl)


def test_cli_prints_summary(tmp_path, tiny_target):
    data, _ = _data(tmp_path)
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    from eyas.data.cli import register

    register(app)
    res = CliRunner().invoke(
        app,
        [
            "prepare",
            "--target",
            str(tiny_target.path),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--draft-vocab-size",
            "50",
            "--workers",
            "1",
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "read 18 conversations, kept 14, dropped 4" in res.output
    assert "malformed_json" in res.output and "trained on" in res.output
    # a drop that a setting would keep names it; one that is the input's fault does not
    lines = res.output.splitlines()
    assert next(x for x in lines if "x starts_with_assistant" in x).endswith(
        "--leading-assistant trim keeps them without their leading assistant messages"
    )
    assert "--" not in next(x for x in lines if "x malformed_json" in x)
    assert open_prepared(tmp_path / "o").manifest["draft_vocab_size"] == 50
