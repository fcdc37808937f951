"""The hidden-state store and the `eyas extract` stage: content, resume after SIGKILL, verify."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from eyas.errors import EyasError
from eyas.features.capture import HiddenStateCapture
from eyas.extract.config import ExtractConfig
from eyas.extract.run import plan_batches, extract
from eyas.features.reader import open_store
from eyas.features.verify import verify_store
from eyas.features.writer import StoreWriter

LAYERS = [1, 4, 6]


def _prepared(root: Path, target, n: int, seed: int = 0, max_len: int = 60) -> Path:
    from eyas.data.dataset import write_prepared

    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len, n)
    ids = [rng.integers(5, 300, k).tolist() for k in lens]
    masks = [rng.integers(0, 2, k).tolist() for k in lens]
    vocab = target.config()["vocab_size"]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:16] = True
    return write_prepared(
        root, ids, masks, [f"test:{i}" for i in range(n)], target, torch.zeros(16, dtype=torch.long), t2d
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_target):
    return _prepared(tmp_path_factory.mktemp("prep") / "p", tiny_target, 40)


def _fields(n: int = 3, **kw):
    f = {
        "target": {"id": "x"},
        "aux_layers": [1, 2],
        "final_layer": 4,
        "convention": "c",
        "dtype": "fp32",
        "hidden_size": 8,
        "num_samples": n,
    }
    f.update(kw)
    return f


def test_plan_is_length_sorted_and_bounded():
    lengths = np.array([5, 50, 7, 49, 1, 120, 30])
    plan = plan_batches(lengths, 100)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert len(b) == 1 or len(b) * max(lengths[b]) <= 100
    assert plan[0] == [5]  # longer than the budget: a batch of its own
    assert plan == plan_batches(lengths, 100)


def test_extract_stores_each_sample_like_a_lone_forward(tmp_path, data, tiny_target):
    s = extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=tmp_path / "st",
            layers=LAYERS,
            dtype="fp32",
            batch_tokens=200,
            progress=False,
        )
    )
    reader = open_store(tmp_path / "st")
    m = reader.manifest
    assert m["complete"] and m["aux_layers"] == LAYERS and m["final_layer"] == 8
    assert m["convention"] == "vllm-input-of-layer" and m["target"] == tiny_target.identity
    assert len(reader) == 40 and len(m["shards"]) > 3  # several multi-sample shards
    assert s["tokens"] == m["tokens"] == int(sum(m["samples"]["length"]))
    assert s["bytes_per_token"] > 4 * 64 * 4  # 4 slots x H=64 x fp32 plus ids/mask/header
    from eyas.data.dataset import open_prepared

    ds = open_prepared(data)
    model = tiny_target.load_model(dtype=torch.float32)
    with HiddenStateCapture(model, LAYERS) as cap:
        for i in (0, 7, 23, 39):
            smp, ref = reader[i], ds[i]
            aux, final = cap.capture(torch.from_numpy(ref.input_ids)[None])
            assert torch.equal(smp.input_ids, torch.from_numpy(ref.input_ids))
            assert torch.equal(smp.loss_mask, torch.from_numpy(ref.loss_mask))
            torch.testing.assert_close(smp.aux, aux[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(smp.final, final[0], rtol=1e-5, atol=1e-5)
    seen = [x.index for x in reader.iter_shard_order()]
    assert sorted(seen) == list(range(40))
    shard_of = dict(zip(m["samples"]["index"], m["samples"]["shard"]))
    assert [shard_of[i] for i in seen] == sorted(shard_of[i] for i in seen)


def test_default_dtype_is_bf16_and_rerun_is_a_noop(tmp_path, data, tiny_target):
    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=tmp_path / "st",
            layers=LAYERS,
            batch_tokens=300,
            progress=False,
        )
    )
    r = open_store(tmp_path / "st")
    assert r.manifest["dtype"] == "bf16" and r[3].aux.dtype == torch.bfloat16
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "st").glob("shard-*")}
    s = extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=tmp_path / "st",
            layers=LAYERS,
            batch_tokens=300,
            progress=False,
        )
    )
    assert s["tokens"] == 0 and s["resumed_from"] == 40
    assert before == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "st").glob("shard-*")}


def test_resume_with_other_settings_is_refused(tmp_path, data, tiny_target):
    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=tmp_path / "st",
            layers=LAYERS,
            batch_tokens=300,
            progress=False,
        )
    )
    with pytest.raises(EyasError, match="aux_layers"):
        extract(
            ExtractConfig(
                target=str(tiny_target.path),
                data=data,
                out=tmp_path / "st",
                layers=[2, 3, 4],
                batch_tokens=300,
                progress=False,
            )
        )


def test_data_for_another_target_is_refused(tmp_path, data):
    from eyas.target import resolve_target

    other = resolve_target(tiny.make_target(tmp_path / "other", "qwen2", num_layers=4, seed=3))
    with pytest.raises(EyasError, match="another target"):
        extract(ExtractConfig(target=str(other.path), data=data, out=tmp_path / "st", layers=[1, 2], progress=False))


def test_nan_state_stops_the_run_naming_the_sample(tmp_path, tiny_target):
    from eyas.data.dataset import write_prepared

    model = tiny_target.load_model(dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[77] = float("nan")
    bad_dir = tmp_path / "bad"
    model.save_pretrained(bad_dir)
    for f in tiny_target.path.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (bad_dir / f.name).write_bytes(f.read_bytes())
    from eyas.target import resolve_target

    bad = resolve_target(bad_dir)
    ids = [[5, 6, 7, 8], [9, 10, 11], [12, 77, 13, 14, 15], [16, 17]]
    vocab = bad.config()["vocab_size"]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:4] = True
    write_prepared(
        tmp_path / "p",
        ids,
        [[1] * len(x) for x in ids],
        ["t:0", "t:1", "t:2", "t:3"],
        bad,
        torch.zeros(4, dtype=torch.long),
        t2d,
    )
    with pytest.raises(EyasError, match=r"sample 2\b.*NaN"):
        extract(
            ExtractConfig(
                target=str(bad_dir),
                data=tmp_path / "p",
                out=tmp_path / "st",
                layers=[1, 2, 3],
                batch_tokens=4,
                progress=False,
            )
        )
    assert not open_store(tmp_path / "st", allow_incomplete=True).manifest.get("complete")


def test_verify_names_corrupt_and_missing_shards(tmp_path, data, tiny_target):
    st = tmp_path / "st"
    extract(
        ExtractConfig(target=str(tiny_target.path), data=data, out=st, layers=LAYERS, batch_tokens=200, progress=False)
    )
    assert verify_store(st) == []
    shards = sorted(st.glob("shard-*.safetensors"))
    with open(shards[1], "r+b") as fh:  # flip one byte inside the state data
        fh.seek(shards[1].stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))
    shards[2].unlink()
    problems = verify_store(st)
    assert any(shards[1].name in p and "checksum" in p for p in problems)
    assert any(shards[2].name in p and "missing" in p for p in problems)
    from typer.testing import CliRunner

    from eyas.cli import app

    res = CliRunner().invoke(app, ["extract", "--verify", str(st)])
    assert res.exit_code == 1 and shards[1].name in res.output


def test_writer_add_path_resume_and_debris(tmp_path):
    st = tmp_path / "st"
    w = StoreWriter(st, _fields(3), shard_tokens=5, num_writers=2)
    states = {i: torch.randn(4 + i, 3, 8) for i in range(3)}
    for i in (0, 1):
        w.add(i, torch.arange(4 + i), torch.ones(4 + i, dtype=torch.bool), states[i][:, :2], states[i][:, 2])
    with pytest.raises(EyasError, match="already"):
        w.add(0, torch.arange(4), torch.ones(4, dtype=torch.bool), states[0][:, :2], states[0][:, 2])
    m = w.close()
    assert not m["complete"]
    # debris of a crashed writer: a temp file and a renamed shard whose record was never written
    (st / ".shard-000009.safetensors.tmp1-2").write_bytes(b"half")
    (st / "shard-000008.safetensors").write_bytes(b"looks whole")
    with pytest.raises(EyasError, match="incomplete"):
        open_store(st)
    w = StoreWriter(st, _fields(3), shard_tokens=5)
    assert w.done == {0, 1}
    assert not (st / "shard-000008.safetensors").exists()
    assert not (st / ".shard-000009.safetensors.tmp1-2").exists()
    w.add(2, torch.arange(6), torch.zeros(6, dtype=torch.bool), states[2][:, :2], states[2][:, 2])
    assert w.close()["complete"]
    r = open_store(st)
    for i in range(3):
        assert torch.equal(r[i].aux, states[i][:, :2]) and torch.equal(r[i].final, states[i][:, 2])
        assert torch.equal(r[i].input_ids, torch.arange(4 + i))
    assert verify_store(st) == []
    with pytest.raises(EyasError, match="hidden_size"):
        StoreWriter(st, _fields(3, hidden_size=16))


def _cli(target: Path, data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eyas.cli",
        "extract",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--layers",
        "1,4,6",
        "--batch-tokens",
        "96",
        "--writers",
        "2",
        "--device",
        "cpu",
    ]


def _store_content(st: Path) -> tuple[dict, dict]:
    m = json.loads((st / "manifest.json").read_text())
    r = open_store(st)
    states = {i: (r[i].aux.clone(), r[i].final.clone(), r[i].input_ids.clone()) for i in range(len(r))}
    return m, states


def test_sigkill_at_any_moment_then_resume_gives_the_same_store(tmp_path, tiny_target):
    data = _prepared(tmp_path / "p", tiny_target, 400, seed=5, max_len=90)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ref = tmp_path / "ref"
    subprocess.run(_cli(tiny_target.path, data, ref), check=True, env=env, capture_output=True)
    ref_m, ref_states = _store_content(ref)
    n_shards = len(ref_m["shards"])
    assert n_shards > 20
    for kill_after in (1, n_shards // 2):
        st = tmp_path / f"st{kill_after}"
        proc = subprocess.Popen(
            _cli(tiny_target.path, data, st), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.time() + 300  # a loaded 2-core machine can take minutes to import torch
        while time.time() < deadline and len(list(st.glob("shard-*.json"))) < kill_after:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stored = len(list(st.glob("shard-*.json")))
        assert 0 < stored < n_shards, f"kill landed outside the run ({stored} of {n_shards})"
        res = subprocess.run(_cli(tiny_target.path, data, st), env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        m, states = _store_content(st)
        assert m["samples"] == ref_m["samples"]
        assert [s["checksum"] for s in m["shards"]] == [s["checksum"] for s in ref_m["shards"]]
        assert states.keys() == ref_states.keys()
        for i, (a, f, ids) in ref_states.items():
            assert torch.equal(states[i][0], a) and torch.equal(states[i][1], f)
            assert torch.equal(states[i][2], ids)
        assert verify_store(st) == []
        assert not [p for p in st.iterdir() if p.name.startswith(".shard")]


def _copy_store(src: Path, dst: Path, dtype: str, edit=None) -> Path:
    """Rewrite ``src``'s samples into a new store of ``dtype``; ``edit(index, states)`` may change them."""
    r = open_store(src)
    m = r.manifest
    fields = {k: m[k] for k in ("target", "aux_layers", "final_layer", "convention", "hidden_size", "num_samples")}
    w = StoreWriter(dst, {**fields, "dtype": dtype}, shard_tokens=300, num_writers=1)
    for s in r.iter_shard_order():
        states = torch.cat([s.aux, s.final[:, None]], dim=1).float()
        if edit:
            edit(s.index, states)
        w.add(s.index, s.input_ids, s.loss_mask, states[:, :-1], states[:, -1])
    w.close()
    return dst


def test_against_compares_states_token_by_token(tmp_path, data, tiny_target):
    from typer.testing import CliRunner

    from eyas.cli import app

    ref = tmp_path / "ref"
    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=ref,
            layers=LAYERS,
            dtype="fp32",
            batch_tokens=200,
            progress=False,
        )
    )
    same = _copy_store(ref, tmp_path / "bf16", "bf16")  # bf16 rounding: cosine ~ 1 - 1e-5
    res = CliRunner().invoke(app, ["extract", "--verify", str(same), "--against", str(ref)])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["samples"] == 40 and rep["tokens"] == open_store(ref).manifest["tokens"]
    assert len(rep["slots"]) == 4 and all(0.999 < s["min_cosine"] <= 1.0 + 1e-6 for s in rep["slots"])

    r = open_store(ref)
    victim = int(r.indices[np.argmax(r.lengths > 4)])

    def flip(index, states):  # one token of the first aux layer pointed the other way
        if index == victim:
            states[3, 0] = -states[3, 0]

    bad = _copy_store(ref, tmp_path / "bad", "fp32", flip)
    res = CliRunner().invoke(app, ["extract", "--verify", str(bad), "--against", str(ref)])
    assert res.exit_code == 1
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert not rep["ok"] and rep["rows_below"] == 1 and rep["worst_rows"][0]["sample"] == victim
    first = rep["slots"][0]
    assert (first["worst_sample"], first["worst_token"], first["tokens_below"]) == (victim, 3, 1)
    assert first["min_cosine"] == pytest.approx(-1.0, abs=1e-5)
    assert all(s["tokens_below"] == 0 for s in rep["slots"][1:])

    other = tmp_path / "other"
    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=_prepared(tmp_path / "p2", tiny_target, 40, seed=5),
            out=other,
            layers=LAYERS,
            dtype="fp32",
            batch_tokens=200,
            progress=False,
        )
    )
    res = CliRunner().invoke(app, ["extract", "--verify", str(other), "--against", str(ref)])
    assert res.exit_code != 0 and "tokens or loss mask differ" in str(res.exception or res.output)
