"""`eyas prepare --regenerate` on a tiny random target: structure, conditioning, resume, counts."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from eyas.data import regenerate as regen
from eyas.data.dataset import open_prepared
from eyas.data.prepare import PrepareOptions, RegenerateOptions, prepare
from eyas.errors import EyasError


def _data(tmp_path, n=3):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}: the quick brown fox?"},
                {"from": "gpt", "value": "ORIGINAL ANSWER ONE"},
                {"from": "human", "value": f"and capital of France {i}?"},
                {"from": "gpt", "value": "ORIGINAL ANSWER TWO"},
            ]
        }
        for i in range(n)
    ]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f, rows


def _opts(out, target_dir, data, **kw):
    r = dict(temperature=0.8, top_p=0.9, max_new_tokens=4, seed=3, batch_size=2, device="auto", backend="hf")
    r.update(kw)
    return PrepareOptions(
        out=out,
        target=str(target_dir),
        data=[str(data)],
        draft_vocab_size=40,
        max_length=256,
        workers=1,
        progress=False,
        regenerate=RegenerateOptions(**r),
    )


def _cache(out):
    return [json.loads(line) for line in (out / regen.CACHE).read_text().splitlines()]


def _killed_in_second_batch(monkeypatch, opts) -> None:
    """A regeneration interrupted as its second batch starts: the first batch's answers are kept."""
    real = regen._generate
    calls = []

    def crash_on_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(regen, "_generate", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        prepare(opts, log=lambda s: None)


def test_regenerate_structure_conditioning_and_resume(tmp_path, tiny_target, monkeypatch):
    data, rows = _data(tmp_path)
    out = tmp_path / "out"
    real = regen._generate
    _killed_in_second_batch(monkeypatch, _opts(out, tiny_target.path, data))
    first = _cache(out)
    assert len(first) == 2 and {r["turn"] for r in first} == {0}  # one batch of round 0 survived

    calls = []
    monkeypatch.setattr(regen, "_generate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    m = prepare(_opts(out, tiny_target.path, data), log=lambda s: None)
    # 1 first-turn prompt left and 3 second turns, in batches of 2: a second turn is asked as soon
    # as its first answer is there, so the left-over first turn shares a batch with one of them
    assert len(calls) == 2
    cache = _cache(out)
    assert cache[:2] == first  # cached answers are kept, not regenerated
    assert sorted((r["id"], r["turn"]) for r in cache) == sorted((f"c:{i}", t) for i in range(3) for t in (0, 1))
    r = m["regenerate"]
    assert r["settings"] == {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 4, "seed": 3}
    assert r["answers"] == 6
    assert r["length_limited"] == sum(c["finish"] == "length" for c in cache)
    assert r["empty"] == 0 and m["counts"]["samples"] == 3

    # Each sample = the original user turns + the regenerated answers, rendered by the template;
    # each turn-1 prompt was conditioned on the regenerated (not the original) first answer.
    tok = tiny_target.load_tokenizer()
    answers = {(c["id"], c["turn"]): c["text"] for c in cache}
    ds = open_prepared(out, tiny_target)
    for s, (i, row) in zip(ds, enumerate(rows)):
        sid = f"c:{i}"
        assert s.source_id == sid
        msgs = [
            {"role": "user", "content": row["conversations"][0]["value"]},
            {"role": "assistant", "content": answers[(sid, 0)]},
            {"role": "user", "content": row["conversations"][2]["value"]},
            {"role": "assistant", "content": answers[(sid, 1)]},
        ]
        expect = tok.apply_chat_template(msgs, tokenize=False)
        np.testing.assert_array_equal(s.input_ids, tok(expect, add_special_tokens=False)["input_ids"])
        assert "ORIGINAL" not in tok.decode(s.input_ids)
        prompt1 = tok.apply_chat_template(msgs[:3], tokenize=False, add_generation_prompt=True)
        turn1 = next(c for c in cache if c["id"] == sid and c["turn"] == 1)
        assert turn1["prompt_tokens"] == len(tok(prompt1, add_special_tokens=False)["input_ids"])

    # other sampling settings are refused, naming the field
    with pytest.raises(EyasError, match="temperature"):
        prepare(_opts(out, tiny_target.path, data, temperature=0.5), log=lambda s: None)


def test_auto_backend_goes_on_with_the_engine_that_made_the_answers(tmp_path, tiny_target, monkeypatch):
    """--gen-backend auto resumed where another engine has become findable keeps the one recorded in
    regenerate.json: a partial set is not finished by another engine (nor refused for it)."""
    from eyas.vllm.find import installed_vllm_version

    if installed_vllm_version():
        pytest.skip("vLLM is in eyas's own environment: auto cannot be made to miss it")
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("EYAS_VLLM_VENVS", str(tmp_path / "no-venvs"))
    data, _ = _data(tmp_path)
    out = tmp_path / "out"
    real = regen._generate
    _killed_in_second_batch(monkeypatch, _opts(out, tiny_target.path, data, backend="auto"))
    assert json.loads((out / regen.HEADER).read_text())["engine"] == "hf" and len(_cache(out)) == 2

    # now a vLLM is findable, so auto would take it for a new --out
    monkeypatch.setenv("EYAS_VLLM_PYTHON", sys.executable)
    assert regen._pick_engine(RegenerateOptions(backend="auto")) == "vllm"
    monkeypatch.setattr(regen, "_generate", real)
    m = prepare(_opts(out, tiny_target.path, data, backend="auto"), log=lambda s: None)
    assert m["regenerate"]["engine"] == "hf" and m["regenerate"]["answers"] == 6 and len(_cache(out)) == 6


def _coin_target(tmp_path, tiny_target):
    """Zero final norm -> all logits 0 -> uniform sampling; half the vocab are stop tokens.

    So answers end empty, after some text, or at --max-new-tokens, by the seed's coin flips.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    d = tmp_path / "coin"
    shutil.copytree(tiny_target.path, d)
    (d / ".eyas-identity.json").unlink(missing_ok=True)
    model = AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(d)
    newline = tiny_target.load_tokenizer().convert_tokens_to_ids("\u010a")
    stops = [2] + [i for i in range(10, model.config.vocab_size, 2) if i != newline]
    GenerationConfig(eos_token_id=stops, pad_token_id=3).save_pretrained(d)
    return d


def test_finish_reasons_are_counted_and_handled(tmp_path, tiny_target, monkeypatch):
    coin = _coin_target(tmp_path, tiny_target)
    data, _ = _data(tmp_path, n=8)
    kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0, batch_size=4)
    out = tmp_path / "keep"
    m = prepare(_opts(out, coin, data, **kw), log=lambda s: None)
    cache = _cache(out)
    by_conv: dict[str, list[str]] = {}
    for c in sorted(cache, key=lambda c: (c["id"], c["turn"])):
        by_conv.setdefault(c["id"], []).append(c["finish"])
    finishes = [f for fs in by_conv.values() for f in fs]
    assert {"empty", "length", "stop"} <= set(finishes)  # the seed gives every case
    for fs in by_conv.values():  # nothing is generated after an empty answer
        assert "empty" not in fs[:-1]
    empty = {k for k, fs in by_conv.items() if "empty" in fs}
    limited = {k for k, fs in by_conv.items() if "length" in fs and k not in empty}
    r = m["regenerate"]
    assert r["empty"] == len(empty) and r["length_limited"] == finishes.count("length")
    assert m["counts"]["dropped"] == {"empty_answer": len(empty)}
    assert m["counts"]["samples"] == 8 - len(empty)  # length-limited answers are kept by default
    from eyas.data.prepare import summary_lines

    said = next(line for line in summary_lines(m) if line.startswith("regenerated "))
    assert said.startswith(
        f"regenerated {r['answers']} answers ({r['length_limited']} hit --max-new-tokens, {r['empty']} empty) "
        "with temperature 1.0, top_p 1.0, max_new_tokens 2, seed 0 on hf;"
    )

    # --drop-length-limited, reusing the answer cache (copied): nothing is generated again
    out2 = tmp_path / "drop"
    out2.mkdir()
    for name in (regen.CACHE, regen.HEADER):
        shutil.copy(out / name, out2 / name)
    monkeypatch.setattr(regen, "_generate", lambda *a, **k: pytest.fail("cache not used"))
    m2 = prepare(_opts(out2, coin, data, drop_length_limited=True, **kw), log=lambda s: None)
    assert m2["counts"]["dropped"] == {"empty_answer": len(empty), "length_limited_answer": len(limited)}
    assert m2["counts"]["samples"] == 8 - len(empty) - len(limited)


def test_trimmed_conversations_add_only_their_own_answers_to_a_seeded_cache(tmp_path, tiny_target, monkeypatch):
    """`--leading-assistant trim` keeps the conversations that start with the assistant: seeded with
    the answers of a run that skipped them, it answers only theirs; the other run's directory refuses
    the new setting by name."""
    data, rows = _data(tmp_path)
    split = {
        "conversations": [
            {"from": "gpt", "value": "...the end of an earlier answer."},
            {"from": "human", "value": "and then?"},
            {"from": "gpt", "value": "ORIGINAL ANSWER THREE"},
        ]
    }
    data.write_text(data.read_text() + json.dumps(split) + "\n")
    skipped = tmp_path / "skipped"
    m = prepare(_opts(skipped, tiny_target.path, data), log=lambda s: None)
    assert m["counts"]["samples"] == 3 and m["counts"]["dropped"] == {"starts_with_assistant": 1}

    trimmed = tmp_path / "trimmed"
    trimmed.mkdir()
    for name in (regen.CACHE, regen.HEADER):
        shutil.copy(skipped / name, trimmed / name)
    asked = []
    real = regen._generate
    monkeypatch.setattr(regen, "_generate", lambda *a, **kw: asked.append(a) or real(*a, **kw))
    opts = _opts(trimmed, tiny_target.path, data)
    opts.leading_assistant = "trim"
    m = prepare(opts, log=lambda s: None)
    assert len(asked) == 1  # one batch: the trimmed conversation's one turn
    assert m["counts"]["samples"] == 4 and m["counts"]["trimmed_leading_assistant"] == 1
    assert m["trimmed_example"].endswith(":4") and m["regenerate"]["answers"] == 7
    cache = _cache(trimmed)
    assert cache[:6] == _cache(skipped) and (cache[6]["id"], cache[6]["turn"]) == ("c:3", 0)

    with pytest.raises(EyasError, match="leading_assistant: 'skip' there, 'trim' now"):
        prepare(opts.__class__(**{**vars(opts), "out": skipped}), log=lambda s: None)
