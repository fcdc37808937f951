"""Interface A: write_prepared / open_prepared round trip, target checks, draft vocab rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eyas.data.dataset import open_prepared, write_prepared
from eyas.data.vocab import build_draft_vocab, count_trained_tokens, draft_to_target_ids
from eyas.errors import EyasError


def _samples(rng, n, vocab):
    ids, masks, srcs = [], [], []
    for i in range(n):
        t = int(rng.integers(3, 40))
        ids.append(rng.integers(0, vocab, size=t).tolist())
        m = np.zeros(t, dtype=np.int8)
        m[t // 2 :] = 1
        masks.append(m.tolist())
        srcs.append(f"unit:{i}")
    return ids, masks, srcs


def test_round_trip(tmp_path, tiny_target):
    vocab = tiny_target.config()["vocab_size"]
    rng = np.random.default_rng(0)
    ids, masks, srcs = _samples(rng, 23, vocab)
    counts = count_trained_tokens([np.array(x) for x in ids], [np.array(m) for m in masks], vocab)
    d2t, t2d, cov = build_draft_vocab(counts, 50)
    out = write_prepared(
        tmp_path / "ds", ids, masks, srcs, tiny_target, d2t, t2d, extra_manifest={"note": "x"}, shard_size=10
    )
    ds = open_prepared(out, tiny_target)
    assert len(ds) == 23
    assert len(ds.manifest["shards"]) == 3
    assert ds.manifest["kind"] == "eyas-prepared"
    assert ds.manifest["target"] == tiny_target.identity
    assert ds.manifest["note"] == "x"
    assert ds.manifest["counts"]["trained_tokens"] == sum(sum(m) for m in masks)
    assert ds.manifest["coverage"] == pytest.approx(cov)
    assert ds.manifest["chat_template_sha256"]  # the tiny tokenizer has a ChatML template
    np.testing.assert_array_equal(ds.lengths, [len(x) for x in ids])
    for i in (0, 9, 10, 22, -1):
        s = ds[i]
        j = i % 23
        assert s.index == j and s.source_id == srcs[j]
        assert s.input_ids.dtype == np.int64 and s.loss_mask.dtype == bool
        np.testing.assert_array_equal(s.input_ids, ids[j])
        np.testing.assert_array_equal(s.loss_mask, np.array(masks[j], dtype=bool))
    with pytest.raises(IndexError):
        ds[23]
    d2t2, t2d2 = ds.draft_vocab()
    assert d2t2.dtype == torch.int64 and t2d2.dtype == torch.bool
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)
    # refuses to overwrite
    with pytest.raises(EyasError, match="already exists"):
        write_prepared(out, ids, masks, srcs, tiny_target, d2t, t2d)


def test_open_refuses_other_target(tmp_path, tiny_target):
    vocab = tiny_target.config()["vocab_size"]
    d2t, t2d, _ = build_draft_vocab(np.zeros(vocab, np.int64), 8)
    out = write_prepared(tmp_path / "ds", [[1, 2, 3]], [[0, 1, 1]], ["a:0"], tiny_target, d2t, t2d)
    m = json.loads((out / "manifest.json").read_text())
    m["target"]["weights"] = "0000"
    (out / "manifest.json").write_text(json.dumps(m))
    open_prepared(out)  # no target given: no check
    with pytest.raises(EyasError, match="target.weights"):
        open_prepared(out, tiny_target)
    (out / "manifest.json").unlink()
    with pytest.raises(EyasError, match="not a finished"):
        open_prepared(out)


def test_draft_vocab_rules():
    counts = np.array([0, 5, 5, 1, 9, 0, 0, 2], dtype=np.int64)
    d2t, t2d, cov = build_draft_vocab(counts, 3)
    # most frequent: 4 (9), then tie 1/2 (5) -> {1,2,4}; sorted by id
    ids = draft_to_target_ids(d2t)
    assert ids.tolist() == sorted(np.argsort(-counts, kind="stable")[:3].tolist())
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    assert cov == pytest.approx(counts[ids.numpy()].sum() / counts.sum())
    # tie broken by id: size 2 keeps 4 and the lower of 1/2
    assert draft_to_target_ids(build_draft_vocab(counts, 2)[0]).tolist() == [1, 4]
    # fewer distinct tokens than the size: fill with the lowest unused ids, exact size
    # (seen: 1,2,3,4,7; the two fills are 0 and 5)
    d2t7, t2d7, cov7 = build_draft_vocab(counts, 7)
    assert draft_to_target_ids(d2t7).tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert int(t2d7.sum()) == 7 and cov7 == pytest.approx(1.0)
    assert build_draft_vocab(counts, 4)[2] == pytest.approx(21 / 22)
    # capped at the vocab
    assert build_draft_vocab(counts, 100)[0].shape[0] == 8
    with pytest.raises(EyasError):
        build_draft_vocab(counts, 0)
