"""Loops in answers (eyas.data.loops) and `eyas prepare --mask-loops` on a tiny target."""

from __future__ import annotations

import json

import numpy as np
import pytest

import test_prepare
from eyas.data.dataset import open_prepared
from eyas.data.loops import KEPT_PERIODS, MIN_LOOP_TOKENS, loop_start
from eyas.data.prepare import prepare
from eyas.errors import EyasError


def test_a_cycle_to_the_end_is_cut_after_its_kept_periods():
    rng = np.random.default_rng(0)
    head = rng.integers(100, 200, size=40)
    cycle = np.array([7, 8, 9, 10, 11])
    ids = np.concatenate([head, np.tile(cycle, 20), cycle[:3]])  # cut mid-cycle, as at a length cap
    cut = loop_start(ids)
    assert cut == len(head) + KEPT_PERIODS * len(cycle)
    # what stays trained on holds the cycle twice; every masked token repeats the one a period back
    assert (ids[cut:] == ids[cut - len(cycle) : len(ids) - len(cycle)]).all()


def test_a_single_token_loop_and_the_shortest_period():
    ids = np.array([5, 6, 7] + [3] * 50)
    assert loop_start(ids) == 3 + KEPT_PERIODS  # period 1, not 2 or 5


def test_no_loop_no_cut():
    rng = np.random.default_rng(1)
    assert loop_start(rng.integers(0, 10_000, size=500)) is None
    # an answer ending in a short repeat ("!!!", a closing list) is not a loop
    assert loop_start(np.array(list(range(100, 160)) + [4] * (MIN_LOOP_TOKENS - 1))) is None
    # a cycle inside the answer that does not run to its end is not cut either
    assert loop_start(np.array([1, 2] * 40 + list(range(300, 340)))) is None
    assert loop_start(np.array([], dtype=np.int64)) is None


def _data(tmp_path):
    loop = " ".join(["the lazy dog jumps over the fox."] * 30)  # a looping answer
    rows = [
        {"id": "loop", "messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": loop}]},
        {
            "id": "plain",
            "messages": [
                {"role": "user", "content": "capital of France?"},
                {"role": "assistant", "content": "Paris. Berlin is the capital of Germany."},
            ],
        },
    ]
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _opts(out, target, data, **kw):
    return test_prepare._opts(out, target, data, max_length=1024, **kw)  # the looping answer whole


def test_prepare_mask_loops_trains_the_loop_twice_and_counts_the_rest(tmp_path, tiny_target):
    data = _data(tmp_path)
    plain = prepare(_opts(tmp_path / "plain", tiny_target, data, mask_loops=False), log=lambda s: None)
    masked = prepare(_opts(tmp_path / "masked", tiny_target, data), log=lambda s: None)  # the default
    a, b = open_prepared(tmp_path / "plain"), open_prepared(tmp_path / "masked")
    (la, pa), (lb, pb) = (a[0], a[1]), (b[0], b[1])
    np.testing.assert_array_equal(la.input_ids, lb.input_ids)  # the same tokens, as context
    np.testing.assert_array_equal(pa.loss_mask, pb.loss_mask)  # the answer without a loop: untouched
    cut = int(np.flatnonzero(la.loss_mask != lb.loss_mask)[0])
    assert lb.loss_mask[:cut].sum() > 0 and lb.loss_mask[cut:].sum() == 0  # nothing trained after the cut
    ids = np.asarray(la.input_ids)
    start = int(np.flatnonzero(la.loss_mask)[0])
    assert loop_start(ids[start : int(np.flatnonzero(la.loss_mask)[-1])]) == cut - start
    left_out = int(la.loss_mask.sum() - lb.loss_mask.sum())
    assert masked["counts"]["loop_tokens"] == left_out > 0
    assert masked["counts"]["trained_tokens"] == plain["counts"]["trained_tokens"] - left_out
    assert plain["counts"]["loop_tokens"] == 0


def test_a_dataset_made_before_mask_loops_stays_complete(tmp_path, tiny_target):
    data = _data(tmp_path)
    out = tmp_path / "out"
    prepare(_opts(out, tiny_target, data, mask_loops=False), log=lambda s: None)
    m = json.loads((out / "manifest.json").read_text())
    del m["settings"]["mask_loops"]  # as an older eyas wrote it
    (out / "manifest.json").write_text(json.dumps(m))
    logs = []
    prepare(_opts(out, tiny_target, data, mask_loops=False), log=logs.append)
    assert "nothing to do" in logs[0]
    # the default changed since: the error names the setting and the way to keep the dataset
    with pytest.raises(EyasError, match="mask_loops: False there, True now.*Pass the settings it was made with"):
        prepare(_opts(out, tiny_target, data), log=lambda s: None)


def test_cli_masks_loops_by_default_and_no_mask_loops_turns_it_off(tmp_path, tiny_target):
    import typer
    from typer.testing import CliRunner

    from eyas.data.cli import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    data = _data(tmp_path)
    base = ["prepare", "--target", str(tiny_target.path), "--data", str(data), "--max-length", "1024"]
    base += ["--draft-vocab-size", "40", "--workers", "1", "--quiet"]
    for name, extra, masked in (("on", [], True), ("off", ["--no-mask-loops"], False)):
        res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / name), *extra])
        assert res.exit_code == 0, res.output
        m = open_prepared(tmp_path / name).manifest
        assert m["settings"]["mask_loops"] is masked
        assert (m["counts"]["loop_tokens"] > 0) is masked
        assert ("tokens of loops (--mask-loops)" in res.output) is masked
