"""Bad inputs and faults, one test each, named ``test_bad_input_<what>``: every one ends in a named
error (exit 2, a message saying what to change) or the documented recovery, and no input is lost.

The docstring of each test is its row in benchmarks/reliability.md (scripts/reliability_table.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.errors import EyasError


def _conv(i: int) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f"question {i}: the quick brown fox?"},
            {"from": "gpt", "value": f"answer {i}: the lazy dog."},
        ],
    }


def eyas(*args: str) -> tuple[int, str]:
    """Run the `eyas` CLI in-process as `eyas.cli.main` would: (exit code, output + error message)."""
    from eyas.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    if isinstance(res.exception, EyasError):
        return 2, res.output + str(res.exception)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.output


# ------------------------------------------------------------------------------------ data files


def _prepare_args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "prepare",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--draft-vocab-size",
        "40",
        "--max-length",
        "256",
        "--workers",
        "1",
        "--quiet",
        *extra,
    ]


def test_bad_input_json_missing_comma(tmp_path, tiny_llama_dir):
    """`.json` array of 40 items with one missing comma: exit 2 naming the file, the byte offset and
    the reason; nothing is written."""
    text = json.dumps([_conv(i) for i in range(40)])
    at = text.index("}, {", len(text) // 3)
    bad = text[: at + 1] + text[at + 2 :]  # drop one comma between two items
    f = tmp_path / "chats.json"
    f.write_text(bad)
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "out"))
    assert code == 2
    assert f"{f}: not valid JSON at byte {at + 2:,}" in msg and "delimiter" in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_json_invalid_utf8_byte(tmp_path, tiny_llama_dir):
    """`.json` array of 10 items with one 0xFF byte: exit 2 naming the file, the byte offset and
    "not valid UTF-8"; nothing is written."""
    raw = json.dumps([_conv(i) for i in range(10)]).encode()
    at = raw.index(b"question 3")
    f = tmp_path / "chats.json"
    f.write_bytes(raw[:at] + b"\xff" + raw[at:])
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "out"))
    assert code == 2
    assert f"{f}: not valid JSON at byte {at:,}" in msg and "0xff is not valid UTF-8" in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_json_cut_off(tmp_path):
    """`.json` array cut off mid-item (not the known-truncated ShareGPT file): an error naming the
    byte where it ends, not a silent tail drop."""
    from eyas.data.formats import open_source

    text = json.dumps([_conv(i) for i in range(5)])
    f = tmp_path / "cut.json"
    f.write_text(text[:-30])
    with pytest.raises(EyasError, match=rf"not valid JSON at byte {len(text) - 30:,} .*ends there"):
        open_source(str(f))


def test_bad_input_json_known_truncated_sharegpt_is_read_to_the_cut(tmp_path, monkeypatch):
    """The built-in ShareGPT JSON (recognised by its sha256, here stood in for by a cut file whose
    sha256 is registered): the complete items are read and the cut-off tail is reported, as before."""
    from eyas.data import formats
    from eyas.fsio import sha256_file

    assert formats.KNOWN_TRUNCATED_SHA256 == {
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772": "sharegpt"
    }
    text = json.dumps([_conv(i) for i in range(5)])
    f = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    f.write_text(text[:-30])
    monkeypatch.setitem(formats.KNOWN_TRUNCATED_SHA256, sha256_file(f), "sharegpt")
    info, recs = formats.open_source(str(f))
    assert len(list(recs)) == 4 and info.truncated["complete_items"] == 4


def test_bad_input_max_length_too_short_for_any_answer(tmp_path, tiny_llama_dir):
    """`eyas prepare --max-length 8`: every conversation dropped; exit 2 listing the reason
    (no_trained_tokens, with an example) and saying to raise --max-length, not to check --data."""
    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join(json.dumps(_conv(i)) for i in range(6)) + "\n")
    args = _prepare_args(tiny_llama_dir, f, tmp_path / "out")
    args[args.index("--max-length") + 1] = "8"
    code, msg = eyas(*args)
    assert code == 2
    assert "6 x no_trained_tokens" in msg and "raise --max-length (now 8)" in msg
    assert "see the reasons above" not in msg and "check --data" not in msg


# ------------------------------------------------------------------------------ settings: types


def _yaml(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "job.yaml"
    f.write_text(f"target: {tmp_path / 'no-such-target'}\nworkdir: {tmp_path / 'work'}\n" + text)
    return f


def test_bad_input_config_max_steps_ten(tmp_path):
    """YAML `train: {max_steps: "ten"}`: `eyas pipeline` exits 2 naming train.max_steps, the value and
    "an integer" before any stage runs (was: prepare ran, then a TypeError traceback)."""
    cfg = _yaml(tmp_path, "train:\n  max_steps: ten\n")
    code, msg = eyas("pipeline", cfg)
    assert code == 2
    assert f"config {cfg}: train.max_steps = 'ten' is a string; expected an integer" in msg
    assert not (tmp_path / "work").exists()


def test_bad_input_config_lr_1e_4_is_a_number(tmp_path):
    """YAML `lr: 1e-4` (YAML 1.1 reads it as the string "1e-4"): read as the number 0.0001."""
    from eyas.config import load_config

    cfg = load_config(_yaml(tmp_path, "train:\n  lr: 1e-4\n  betas: [0.9, 0.99]\n"))
    assert cfg.section("train")["lr"] == 1e-4 and isinstance(cfg.section("train")["lr"], float)


@pytest.mark.parametrize(
    "text, match",
    [
        ("train:\n  lr: fast\n", "train.lr = 'fast' is a string; expected a number"),
        ("train:\n  compile: 'yes'\n", "train.compile = 'yes' is a string; expected true or false"),
        ("train:\n  layers: 2,3\n", "train.layers = '2,3' is a string; expected a list of integers"),
        ("evaluate:\n  k: 2.5\n", "evaluate.k = 2.5 is a number; expected an integer"),
        ("prepare:\n  regenerate:\n    top_p: high\n", "prepare.regenerate.top_p = 'high' is a string"),
        ("train:\n  max_steps: 1e30\n", "train.max_steps = '1e30' is a number too large to be a count (above 2^53)"),
    ],
    ids=["lr_fast", "compile_yes_string", "layers_string", "k_2.5", "regenerate_top_p_high", "max_steps_1e30"],
)
def test_bad_input_config_value_of_the_wrong_type(tmp_path, text, match):
    """A YAML value of the wrong type: exit 2 naming the key, the value and the expected type,
    before any stage runs."""
    code, msg = eyas("pipeline", _yaml(tmp_path, text))
    assert code == 2 and match in msg
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "text, match",
    [
        ("evaluate:\n  engine: bogus\n", "evaluate.engine = 'bogus' is not one of 'builtin', 'vllm', 'both', 'replay'"),
        ("evaluate:\n  dtype: fp7\n", "evaluate.dtype = 'fp7' is not one of 'auto', 'float32', 'bfloat16', 'float16'"),
        ("train:\n  optimizer: bogus\n", "train.optimizer = 'bogus' is not one of 'muon', 'adamw'"),
        ("train:\n  attention: sdpa\n", "train.attention = 'sdpa' is not one of 'auto', 'dense', 'flex'"),
        ("export:\n  format: onnx\n", "export.format = 'onnx' is not one of 'vllm', 'sglang'"),
        ("extract:\n  dtype: int8\n", "extract.dtype = 'int8' is not one of 'bf16', 'fp16', 'fp32', 'fp8'"),
        (
            "prepare:\n  regenerate:\n    backend: sglang\n",
            "prepare.regenerate.backend = 'sglang' is not one of 'auto', 'hf', 'vllm'",
        ),
    ],
    ids=[
        "evaluate_engine_bogus",
        "evaluate_dtype_fp7",
        "train_optimizer_bogus",
        "train_attention_sdpa",
        "export_format_onnx",
        "extract_dtype_int8",
        "regenerate_backend_sglang",
    ],
)
def test_bad_input_config_value_not_one_of_its_choices(tmp_path, text, match):
    """A YAML value outside its setting's fixed set of values, in any stage: exit 2 naming the key,
    the value and the values allowed, before any stage runs (was: accepted at load, refused only
    when the stage reading it ran, after the stages before it)."""
    code, msg = eyas("pipeline", _yaml(tmp_path, text))
    assert code == 2 and match in msg and "choose one of them" in msg
    assert not (tmp_path / "work").exists()


# ----------------------------------------------------------------------------- settings: ranges


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    # the target does not exist: a range error must come before anything is loaded
    return [
        "train",
        "--target",
        str(tmp_path / "no-such-target"),
        "--data",
        str(tmp_path / "d"),
        "--out",
        str(tmp_path / "run"),
        "--online",
        *extra,
    ]


@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--ttt-steps", "0", "--ttt-steps 0 (training-time-test steps unrolled) must be >= 1"),
        ("--tokens-per-batch", "1", "--tokens-per-batch 1 (tokens per pack) must be >= 3"),
        ("--lr", "-0.001", "--lr -0.001 (peak learning rate) must be > 0"),
        ("--lr", "0", "--lr 0.0 (peak learning rate) must be > 0"),
        ("--max-steps", "0", "--max-steps 0 (optimizer steps) must be >= 1"),
        ("--heldout", "1", "--heldout 1.0 (fraction of samples held out) must be < 1"),
        ("--grad-accum", "0", "--grad-accum 0 (micro-batches per optimizer step) must be >= 1"),
        ("--eval-batches", "0", "--eval-batches 0"),
        ("--warmup", "-1", "--warmup -1 (warmup steps) must be >= 0"),
        ("--lr", "inf", "--lr inf (peak learning rate) is not finite"),
    ],
    ids=[
        "ttt_steps_0",
        "tokens_per_batch_1",
        "lr_negative",
        "lr_0",
        "max_steps_0",
        "heldout_1",
        "grad_accum_0",
        "eval_batches_0",
        "warmup_negative",
        "lr_inf",
    ],
)
def test_bad_input_train_flag_out_of_range(tmp_path, flag, value, match):
    """`eyas train` with a numeric flag out of range: exit 2 naming the flag, the value and the
    allowed range before the target loads (was: an autograd/torch traceback after it loaded, or a
    silent run)."""
    code, msg = eyas(*_train_args(tmp_path, flag, value))
    assert code == 2 and match in msg and "change it" in msg
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--optimizer", "bogus", "'bogus' is not one of 'muon', 'adamw'"),
        ("--schedule", "step", "'step' is not one of 'cosine', 'linear', 'wsd'"),
    ],
    ids=["optimizer_bogus", "schedule_step"],
)
def test_bad_input_train_flag_not_one_of_its_choices(tmp_path, flag, value, match):
    """`eyas train` with a flag outside its fixed set of values: exit 2 naming the flag, the value and
    the values allowed, before the target loads."""
    import re

    code, msg = eyas(*_train_args(tmp_path, flag, value))
    msg = " ".join(re.sub(r"[│╭╮╰╯─]", " ", msg).split())  # typer's error box, unwrapped
    assert code == 2 and f"Invalid value for '{flag}'" in msg and match in msg
    assert not (tmp_path / "run").exists()


def test_bad_input_config_train_ttt_steps_0(tmp_path):
    """YAML `train: {ttt_steps: 0}`: the same range check as the flag, before prepare runs."""
    code, msg = eyas("pipeline", _yaml(tmp_path, "train:\n  ttt_steps: 0\n"))
    assert code == 2 and "train.ttt_steps = 0 (training-time-test steps unrolled) must be >= 1" in msg
    assert not (tmp_path / "work").exists()


def test_bad_input_evaluate_max_new_tokens_0(tmp_path):
    """`eyas evaluate --max-new-tokens 0`: exit 2 before any model loads (was: "tau n/a", exit 0)."""
    code, msg = eyas(
        "evaluate", "--draft", tmp_path / "draft", "--target", tmp_path / "no-target", "--max-new-tokens", "0"
    )
    assert code == 2 and "--max-new-tokens 0 (tokens generated per turn) must be >= 1" in msg


def test_bad_input_evaluate_replay_with_sampling(tmp_path):
    """`eyas evaluate --engine replay --temperature 0.7`: exit 2 before any model loads; replay reads
    greedy acceptance only (with sampling the output depends on the draft)."""
    code, msg = eyas(
        "evaluate",
        "--draft",
        tmp_path / "draft",
        "--target",
        tmp_path / "no-target",
        "--engine",
        "replay",
        "--temperature",
        "0.7",
    )
    assert code == 2 and "replay measures greedy acceptance only" in msg and "--engine builtin or vllm" in msg


@pytest.mark.parametrize(
    "text, match",
    [
        ("evaluate:\n  max_new_tokens: 0\n", "evaluate.max_new_tokens = 0"),
        ("export:\n  num_speculative_tokens: 0\n", "export.num_speculative_tokens = 0"),
        ("prepare:\n  max_length: 1\n", "prepare.max_length = 1"),
        ("prepare:\n  regenerate:\n    temperature: -1\n", "prepare.regenerate.temperature = -1"),
        ("extract:\n  batch_tokens: 0\n", "extract.batch_tokens = 0"),
    ],
    ids=[
        "evaluate_max_new_tokens_0",
        "export_k_0",
        "prepare_max_length_1",
        "regenerate_temperature_negative",
        "extract_batch_tokens_0",
    ],
)
def test_bad_input_config_number_out_of_range(tmp_path, text, match):
    """A YAML number out of range in any stage: exit 2 naming it, before any stage runs."""
    code, msg = eyas("pipeline", _yaml(tmp_path, text))
    assert code == 2 and match in msg
    assert not (tmp_path / "work").exists()


# ---------------------------------------------------------------------------- outputs vs inputs


@pytest.fixture(scope="module")
def export_target(tmp_path_factory):
    import evalkit
    from eyas.target import resolve_target

    return resolve_target(evalkit.make_eval_target(tmp_path_factory.mktemp("exp-target")))


def _run_dir_with_draft(target, run: Path) -> Path:
    """RUN/draft (a saved draft) plus RUN/metrics.jsonl, as `eyas train` leaves them."""
    import test_export

    draft = test_export._draft(target, run / "draft")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return draft


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["draft", "run_dir", "inside_draft", "target"])
def test_bad_input_export_out_overlaps_an_input_with_overwrite(tmp_path, export_target, where):
    """`eyas export DRAFT --out X --overwrite` where X is the draft, its run directory (holds it),
    a directory inside it, or the target: exit 2 naming the overlap; every input file intact
    (was: exit 0 with the draft or the run directory deleted)."""
    run = tmp_path / "run"
    draft = _run_dir_with_draft(export_target, run)
    out = {"draft": draft, "run_dir": run, "inside_draft": draft / "vllm", "target": export_target.path}[where]
    before, tgt_before = _snapshot(run), _snapshot(export_target.path)
    code, msg = eyas("export", draft, "--out", out, "--target", export_target.path, "--overwrite")
    assert code == 2
    how = {"draft": "is", "run_dir": "contains", "inside_draft": "lies inside", "target": "is"}[where]
    assert f"--out {out} {how} the " in msg and "would overwrite that input" in msg
    assert _snapshot(run) == before and _snapshot(export_target.path) == tgt_before


# ---------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def train_data(tiny_target, tmp_path_factory) -> Path:
    import tiny

    return tiny.random_prepared(tmp_path_factory.mktemp("prep") / "data", tiny_target)


@pytest.fixture(scope="module")
def finished_run(tiny_target, train_data, tmp_path_factory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (kept), and its draft."""
    import test_train_run
    from eyas.train.trainer import run as train

    run = tmp_path_factory.mktemp("run") / "run"
    train(test_train_run._cfg(tiny_target, train_data, run, keep_checkpoints=3, eval_every=0))
    return run


def _copy_run(finished_run: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


def _resume(tiny_target, train_data, run: Path):
    import test_train_run
    from eyas.train.trainer import run as train

    return train(test_train_run._cfg(tiny_target, train_data, run, keep_checkpoints=3, eval_every=0, resume=True))


def _draft_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "draft" / "model.safetensors"))


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.json"])
def test_bad_input_checkpoint_latest_file_truncated(tmp_path, tiny_target, train_data, finished_run, capfd, name):
    """`eyas train --resume` when the latest checkpoint's model.safetensors or trainer_state.json is cut
    in half: the file is named, the checkpoint moved aside, and training resumes from the newest complete
    one to the same draft (was: a raw SafetensorError / JSONDecodeError traceback)."""
    import torch

    run = _copy_run(finished_run, tmp_path)
    latest = run / "checkpoints" / "step-00000004"
    f = latest / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    want = _draft_weights(finished_run)
    _resume(tiny_target, train_data, run)
    err = capfd.readouterr().err
    assert f"checkpoint step-00000004 is unreadable ({latest / name}:" in err
    assert "resuming from" in err and "step-00000002" in err
    assert (run / "checkpoints" / ".broken-step-00000004" / name).is_file()
    got = _draft_weights(run)
    assert all(torch.equal(want[k], got[k]) for k in want)  # resumed exactly from step 2


def test_bad_input_checkpoint_pickle_payload_in_optimizer_pt(tmp_path, tiny_target, train_data, finished_run, capfd):
    """A latest checkpoint whose optimizer.pt is a pickle that would run code on load: nothing runs
    (weights_only=True refuses it), the file is named, and --resume falls back to the earlier one
    (was: torch.load(weights_only=False) ran it)."""
    import torch

    run = _copy_run(finished_run, tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"optimizer": Payload(), "scheduler": {}}, run / "checkpoints" / "step-00000004" / "optimizer.pt")
    _resume(tiny_target, train_data, run)
    assert not marker.exists()
    err = capfd.readouterr().err
    assert "optimizer.pt: UnpicklingError" in err and "step-00000002" in err


def test_bad_input_checkpoint_all_unreadable(tmp_path, tiny_target, train_data, finished_run):
    """Every checkpoint unreadable: `--resume` stops with an error naming each file, before training."""
    run = _copy_run(finished_run, tmp_path)
    for c in (run / "checkpoints").glob("step-*"):
        (c / "trainer_state.json").write_text("{")
    with pytest.raises(EyasError, match=r"no checkpoint .* can be read: .*step-00000004.*step-00000002"):
        _resume(tiny_target, train_data, run)


# ------------------------------------------------------------------------------ store corruption


def _flip_a_byte(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def _extract(out: Path, tiny_target, train_data, dtype: str) -> Path:
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract

    extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=train_data,
            out=out,
            layers=[1, 4, 6],
            dtype=dtype,
            device="cpu",
            batch_tokens=400,
            progress=False,
        )
    )
    return out


@pytest.fixture
def store(tmp_path, tiny_target, train_data) -> Path:
    return _extract(tmp_path / "store", tiny_target, train_data, "fp32")


def test_bad_input_store_shard_flipped_byte_stops_training(tmp_path, tiny_target, train_data, store):
    """Training on a store one of whose shards has a flipped byte: stops at the shard's first read,
    naming the shard and the `eyas extract` re-run that rewrites it (was: trained to the end, silent)."""
    import test_train_run
    from eyas.train.trainer import run as train

    bad = sorted(store.glob("shard-*.safetensors"))[1]
    _flip_a_byte(bad)
    cfg = test_train_run._cfg(
        tiny_target, train_data, tmp_path / "run", features="offline", store=str(store), max_steps=6, eval_every=0
    )
    with pytest.raises(EyasError) as e:
        train(cfg)
    msg = str(e.value)
    assert f"{bad.name} is corrupt (checksum" in msg
    assert f"eyas extract --data {train_data.resolve()} --out {store}" in msg


def test_bad_input_store_shard_flipped_byte_rewritten_by_extract_rerun(tmp_path, tiny_target, train_data, store, capfd):
    """`eyas extract` re-run over a complete store with a flipped byte in one shard: the shard is
    re-checked, named and extracted again, and the store verifies clean (was: "already there")."""
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract
    from eyas.features.verify import verify_store

    bad = sorted(store.glob("shard-*.safetensors"))[1]
    _flip_a_byte(bad)
    assert verify_store(store)
    s = extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=train_data,
            out=store,
            layers=[1, 4, 6],
            dtype="fp32",
            device="cpu",
            batch_tokens=400,
            progress=False,
        )
    )
    assert f"stored shard {bad.name} (checksum" in capfd.readouterr().err
    assert 0 < s["samples"] - s["resumed_from"] < s["samples"]  # only that shard's samples redone
    assert verify_store(store) == []


@pytest.fixture
def fp8_store(tmp_path, tiny_target, train_data) -> Path:
    return _extract(tmp_path / "fp8-store", tiny_target, train_data, "fp8")


def _scale_span(shard: Path) -> tuple[int, int]:
    """File offsets [a, b) of a shard's hidden_scale tensor."""
    from eyas.features.format import read_header

    start, header = read_header(shard)
    a, b = header["hidden_scale"]["data_offsets"]
    return start + a, start + b


def test_bad_input_fp8_store_scale_flipped_byte(tmp_path, tiny_target, train_data, fp8_store):
    """An fp8 store with one flipped byte in a shard's scales: `--verify` names the shard and the
    hidden_scale tensor (exit 1); training stops at the shard's first read, naming it."""
    import test_train_run
    from eyas.features.verify import verify_store
    from eyas.train.trainer import run as train

    bad = sorted(fp8_store.glob("shard-*.safetensors"))[1]
    a, b = _scale_span(bad)
    with open(bad, "r+b") as fh:
        fh.seek((a + b) // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x40]))
    problems = verify_store(fp8_store)
    assert len(problems) == 1 and problems[0].startswith(f"{bad.name}: checksum")
    assert problems[0].endswith("(corrupted in tensor hidden_scale)")
    code, out = eyas("extract", "--verify", fp8_store)
    assert code == 1 and "hidden_scale" in out
    cfg = test_train_run._cfg(
        tiny_target,
        train_data,
        tmp_path / "run",
        features="offline",
        store=str(fp8_store),
        layers=None,
        max_steps=6,
        eval_every=0,
    )
    with pytest.raises(EyasError, match=f"{bad.name} is corrupt"):
        train(cfg)


def test_bad_input_fp8_store_nan_scale_with_consistent_checksums(tmp_path, tiny_target, train_data, fp8_store):
    """An fp8 store whose scale is NaN but whose checksums were written to match (a writer bug, or a
    store edited by hand): `--verify` names the shard, the token and the slot; training refuses the
    shard before using it."""
    import numpy as np

    import test_train_run
    from eyas.features.format import file_checksum, hasher_for
    from eyas.features.verify import verify_store
    from eyas.manifest import read_manifest, write_manifest
    from eyas.train.trainer import run as train

    bad = sorted(fp8_store.glob("shard-*.safetensors"))[0]
    a, b = _scale_span(bad)
    with open(bad, "r+b") as fh:  # token 2, slot 1 of a [N, 4, 1] scale tensor
        fh.seek(a + (2 * 4 + 1) * 4)
        fh.write(np.float32("nan").tobytes())
    rec_path = bad.with_suffix(".json")
    rec = json.loads(rec_path.read_text())
    algo = rec["checksum"]["algo"]
    rec["checksum"]["digest"] = file_checksum(bad, algo)
    h = hasher_for(algo)
    h.update(bad.read_bytes()[a:b])
    rec["tensor_checksums"]["hidden_scale"] = h.hexdigest()
    rec_path.write_text(json.dumps(rec))
    m = read_manifest(fp8_store)
    for sh in m["shards"]:
        if sh["file"] == bad.name:
            sh["checksum"], sh["tensor_checksums"] = rec["checksum"], rec["tensor_checksums"]
    write_manifest(fp8_store, m)
    problems = verify_store(fp8_store)
    assert problems == [
        f"{bad.name}: tensor hidden_scale: 1 scale(s) non-finite or negative (first at "
        "token 2, slot 1: nan); every value of such a group decodes wrong"
    ]
    cfg = test_train_run._cfg(
        tiny_target,
        train_data,
        tmp_path / "run",
        features="offline",
        store=str(fp8_store),
        layers=None,
        max_steps=6,
        eval_every=0,
    )
    with pytest.raises(EyasError, match=f"{bad.name} is corrupt \\(tensor hidden_scale: 1 scale"):
        train(cfg)


@pytest.mark.parametrize(
    "first, again, match",
    [
        (["--dtype", "bf16"], ["--dtype", "fp8"], "dtype: 'bf16' in the store, 'fp8' now"),
        (["--dtype", "fp8"], ["--dtype", "fp8", "--fp8-group-size", "16"], "scale: .*'groups': 1.* in the store"),
    ],
    ids=["bf16_store_resumed_as_fp8", "fp8_store_resumed_with_other_scales"],
)
def test_bad_input_store_resumed_with_another_dtype(tmp_path, tiny_target, train_data, first, again, match):
    """`eyas extract` into an existing store with another --dtype or fp8 scale layout: exit 2 naming
    the field, its value in the store and now; the store is untouched."""
    st = tmp_path / "st"
    args = [
        "extract",
        "--target",
        tiny_target.path,
        "--data",
        train_data,
        "--out",
        st,
        "--layers",
        "1,4,6",
        "--device",
        "cpu",
    ]
    code, out = eyas(*args, *first)
    assert code == 0, out
    before = {p.name: p.read_bytes() for p in st.iterdir() if p.is_file() and p.name != ".lock"}
    code, msg = eyas(*args, *again)
    assert code == 2 and "was made with other settings" in msg
    assert __import__("re").search(match, msg), msg
    assert before == {p.name: p.read_bytes() for p in st.iterdir() if p.is_file() and p.name != ".lock"}


def test_bad_input_extract_out_on_a_filesystem_too_small(tmp_path, tiny_target, train_data, monkeypatch):
    """`eyas extract` whose store needs more than the free space at --out ($EYAS_FREE_BYTES stands in
    for the filesystem): exit 2 before any work, naming the bytes to write and the bytes free, and
    what to do (another --out, fewer samples, --dtype fp8); nothing is written."""
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract

    st = tmp_path / "st"
    args = [
        "extract",
        "--target",
        tiny_target.path,
        "--data",
        train_data,
        "--out",
        st,
        "--layers",
        "1,4,6",
        "--device",
        "cpu",
    ]
    plan = extract(
        ExtractConfig(
            target=str(tiny_target.path), data=train_data, out=st, layers=[1, 4, 6], device="cpu", plan_only=True
        )
    )["plan"]
    need = plan["bytes_todo"]
    monkeypatch.setenv("EYAS_FREE_BYTES", str(need - 1))
    code, msg = eyas(*args)
    assert code == 2
    from eyas.extract.plan import gb

    assert f"this extraction writes {gb(need)}" in msg and f"only {gb(need - 1)} are free" in msg
    assert "--dtype fp8" in msg and "an --out on a larger filesystem" in msg
    assert not st.exists()
    monkeypatch.setenv("EYAS_FREE_BYTES", str(need))
    code, out = eyas(*args)
    assert code == 0, out


# ------------------------------------------------------------------------------ pipeline staleness


def _pipeline(tmp_path: Path, target: Path, **changes) -> Path:
    import yaml

    import test_pipeline

    path = test_pipeline._config(tmp_path, target, "online")
    cfg = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_bad_input_pipeline_rerun_with_changed_train_settings(tmp_path, tiny_llama_dir):
    """`eyas pipeline` re-run after changing train settings (ttt_steps 2 -> 3, max_steps 3 -> 6): exit 2
    naming both fields, nothing run, and pipeline-config.json still describing the draft on disk
    (was: "draft exists, skipping", the old draft evaluated, the record overwritten)."""
    from eyas.config import load_config
    from eyas.pipeline import run_pipeline

    run_pipeline(load_config(_pipeline(tmp_path, tiny_llama_dir)))
    work = tmp_path / "run"
    record = (work / "pipeline-config.json").read_text()
    report = (work / "eval" / "builtin" / "report.json").read_bytes()
    code, msg = eyas("pipeline", _pipeline(tmp_path, tiny_llama_dir, train__ttt_steps=3, train__max_steps=6))
    assert code == 2
    assert "train.ttt_steps: 2 there, 3 now" in msg and "train.max_steps: 3 there, 6 now" in msg
    assert "Nothing was run" in msg
    assert (work / "pipeline-config.json").read_text() == record
    assert json.loads(record)["sections"]["train"]["ttt_steps"] == 2
    assert (work / "eval" / "builtin" / "report.json").read_bytes() == report


def test_bad_input_pipeline_rerun_with_changed_evaluate_settings(tmp_path, tiny_llama_dir):
    """`eyas pipeline` re-run after changing an evaluate setting (max_new_tokens 6 -> 4): evaluate is
    redone (the old evaluation moved aside, not deleted), the draft kept, and the record updated."""
    from eyas.config import load_config
    from eyas.pipeline import run_pipeline

    run_pipeline(load_config(_pipeline(tmp_path, tiny_llama_dir)))
    work = tmp_path / "run"
    draft = work / "train" / "draft" / "model.safetensors"
    stamp = draft.stat().st_mtime_ns
    run_pipeline(load_config(_pipeline(tmp_path, tiny_llama_dir, evaluate__max_new_tokens=4)))
    assert draft.stat().st_mtime_ns == stamp
    assert json.loads((work / "eval" / "builtin" / "report.json").read_text())["max_new_tokens"] == 4
    assert len(list(work.glob("eval.stale-*/builtin/report.json"))) == 1
    rec = json.loads((work / "pipeline-config.json").read_text())
    assert rec["sections"]["evaluate"]["max_new_tokens"] == 4
    assert {s["status"] for s in rec["stages"].values()} == {"done"}


# ------------------------------------------------------------------------------------- prompts


def test_bad_input_prompts_file_not_utf8(tmp_path):
    """An evaluate prompts file with a non-UTF-8 byte: a named error giving the line and byte offset
    (was: a UnicodeDecodeError traceback)."""
    from eyas.evaluate.prompts import read_questions

    good = json.dumps({"question_id": 1, "category": "writing", "turns": ["Hello?"]}) + "\n"
    bad = json.dumps({"question_id": 2, "category": "writing", "turns": ["caf_"]}).encode().replace(b"_", b"\xe9")
    f = tmp_path / "question.jsonl"
    f.write_bytes(good.encode() + bad + b"\n")
    at = len(good) + bad.index(b"\xe9")
    with pytest.raises(EyasError, match=rf"prompts {f}:2: byte 0xe9 at byte {at} of the file is not valid UTF-8"):
        read_questions(f)


# ============================================================= issue 34: outputs, locks, content
#
# Output folders are checked before a stage runs and held by one writer at a time; what a manifest
# names stays inside its folder; inputs are identified by their content; a draft's config is checked
# against its weights; every error is one line (a traceback only with --debug).


def _stage_args(stage: str, tmp_path: Path, out: Path) -> tuple[list, str]:
    """Arguments of `eyas <stage>` writing ``out`` with inputs that do not exist (the output is
    checked before any input is read), and the flag that names ``out`` in messages."""
    missing = tmp_path / "missing"
    if stage == "pipeline":
        cfg = tmp_path / "job.yaml"
        cfg.write_text(f"target: {missing}\nworkdir: {out}\n")
        return ["pipeline", cfg], "workdir"
    return {
        "prepare": ["prepare", "--data", missing / "c.jsonl", "--target", missing, "--out", out],
        "extract": ["extract", "--data", missing, "--target", missing, "--out", out],
        "train": ["train", "--data", missing, "--target", missing, "--out", out, "--online"],
        "export": ["export", missing, "--out", out],
        "evaluate": ["evaluate", "--draft", missing, "--target", missing, "--out", out],
    }[stage], "--out"


@contextlib.contextmanager
def _held_by_another_process(folder: Path):
    """Another process holding the writer lock of ``folder``; yields its pid."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom eyas.outdir import writer_lock\n"
        "with writer_lock(sys.argv[1], command='eyas train'):\n"
        "    print('held', flush=True)\n    sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "held"
        yield p.pid
    finally:
        p.stdin.close()
        p.wait(timeout=60)


@pytest.mark.parametrize("stage", ["prepare", "extract", "train", "export", "evaluate", "pipeline"])
def test_bad_input_second_writer_into_one_out(tmp_path, stage):
    """A second `eyas <stage>` writing into the --out (or the pipeline workdir) that another eyas process
    is writing: exit 2 naming the folder and the holder's pid, before anything is read or written (was:
    a second train died inside the first's temp dir with metrics.jsonl holding steps 1-2 twice; two
    evaluates recorded each turn twice)."""
    out = tmp_path / "out"
    args, flag = _stage_args(stage, tmp_path, out)
    with _held_by_another_process(out) as pid:
        code, msg = eyas(*args)
    assert code == 2, msg
    assert f"{flag} {out} is being written by another eyas process (pid {pid}, `eyas train`" in msg
    assert not out.exists()


@pytest.mark.parametrize("stage", ["prepare", "extract", "train", "export", "evaluate", "pipeline"])
def test_bad_input_out_is_a_file(tmp_path, stage):
    """`--out` (or the pipeline workdir) that is an existing file, for every stage: exit 2 naming it and
    saying to pass a folder, before any input is read; the file is untouched (was: a traceback)."""
    out = tmp_path / "out"
    out.write_text("keep me")
    args, flag = _stage_args(stage, tmp_path, out)
    code, msg = eyas(*args)
    assert code == 2 and f"{flag} {out} is a file, not a folder" in msg
    assert out.read_text() == "keep me"


@pytest.fixture
def unwritable(tmp_path):
    """A folder this user cannot create files in: mode 0555, or (as root, whom modes do not stop) /sys."""
    import tempfile

    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    try:
        fd, name = tempfile.mkstemp(dir="/sys")
    except OSError:
        yield Path("/sys")
        return
    os.close(fd)
    os.unlink(name)
    pytest.skip("no folder here refuses files to this user")


@pytest.mark.parametrize("stage", ["prepare", "extract", "extract_plan", "train", "export", "evaluate", "pipeline"])
def test_bad_input_out_not_writable(tmp_path, unwritable, stage):
    """`--out` (or the pipeline workdir) under a folder this user cannot write (or on a read-only
    filesystem), for every stage and `extract --plan`: exit 2 naming the folder and saying to choose a
    writable --out, before any input is read (was: tracebacks; `--plan` called the place writable)."""
    out = unwritable / "out"
    args, flag = _stage_args(stage.removesuffix("_plan"), tmp_path, out)
    code, msg = eyas(*args, *(["--plan"] if stage == "extract_plan" else []))
    assert code == 2 and f"{flag} {out}: the folder {unwritable} is not writable" in msg


def test_bad_input_export_out_dot_with_overwrite(tmp_path, monkeypatch):
    """`eyas export DRAFT --out . --overwrite` run inside the folder to replace: exit 2 saying --out is the
    current folder, nothing replaced (was: a traceback from renaming `.`)."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    code, msg = eyas("export", tmp_path / "draft", "--out", ".", "--overwrite")
    assert code == 2 and "--out . is the current folder" in msg
    assert (here / "notes.txt").read_text() == "mine"


def test_bad_input_eyas_cache_is_a_file(tmp_path, tiny_llama_dir, monkeypatch):
    """`EYAS_CACHE` pointing at a file: `eyas prepare` exits 2 naming EYAS_CACHE and saying to point it
    at a folder (was: a traceback)."""
    f = tmp_path / "cache"
    f.write_text("")
    monkeypatch.setenv("EYAS_CACHE", str(f))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(_conv(0)) + "\n")
    code, msg = eyas(*_prepare_args(tiny_llama_dir, data, tmp_path / "out"))
    assert code == 2 and f"EYAS_CACHE {f} is a file, not a folder" in msg


# ---------------------------------------------------------------------------- prepare's inputs


@pytest.mark.parametrize(
    "encoding, match",
    [
        ("utf-16", "encoded as UTF-16-LE (it starts with that byte-order mark)"),
        ("utf-16-le", "encoded as UTF-16-LE (no byte-order mark; every other byte is 0)"),
        ("latin-1", ":3: byte 0xe9 at byte"),
    ],
    ids=["utf16_bom", "utf16_no_bom", "latin1"],
)
def test_bad_input_jsonl_in_another_encoding(tmp_path, tiny_llama_dir, encoding, match):
    """A JSONL file of 6 conversations in UTF-16 (with or without a byte-order mark) or Latin-1 to
    `eyas prepare`: exit 2 naming the encoding (or the first byte that is not UTF-8, with its line) and
    the conversion to run; nothing is written (was: exit 0, "read 7" for 6, the first line dropped as
    malformed JSON)."""
    convs = [_conv(i) for i in range(6)]
    convs[2]["conversations"][1]["value"] = "un café"
    f = tmp_path / "chats.jsonl"
    f.write_bytes("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs).encode(encoding))
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "out"))
    assert code == 2 and match in msg and "iconv" in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_json_array_with_utf8_bom(tmp_path):
    """A `.json` array starting with a UTF-8 byte-order mark (as Windows editors save it): read like the
    same file without it, as JSONL lines and prompts files are (was: refused, with advice to run
    `python -m json.tool`, which refuses a BOM too)."""
    from eyas.data.formats import open_source

    f = tmp_path / "chats.json"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps([_conv(i) for i in range(3)]).encode())
    _, recs = open_source(str(f))
    assert [r.data["id"] for r in recs] == ["c0", "c1", "c2"]


def _parquet(path: Path, rows) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([_conv(i) for i in rows]), path)


def test_bad_input_parquet_folder_gained_a_file(tmp_path, tiny_llama_dir):
    """A parquet input folder that gained a file after `eyas prepare`, prepared again into the same --out:
    exit 2 naming data_sha256 (the folder is identified by its content), the dataset untouched (was:
    "already complete ... nothing to do", exit 0, with 6 of 12 rows)."""
    src = tmp_path / "pq"
    src.mkdir()
    _parquet(src / "a.parquet", range(6))
    out = tmp_path / "out"
    code, msg = eyas(*_prepare_args(tiny_llama_dir, src, out))
    assert code == 0, msg
    manifest = (out / "manifest.json").read_bytes()
    _parquet(src / "b.parquet", range(6, 12))
    code, msg = eyas(*_prepare_args(tiny_llama_dir, src, out))
    assert code == 2 and "finished prepared dataset made with other settings (data_sha256:" in msg
    assert (out / "manifest.json").read_bytes() == manifest


def test_bad_input_parquet_file_damaged(tmp_path, tiny_llama_dir):
    """A `.parquet` input cut in half: `eyas prepare` exits 2 naming the file and saying it is damaged,
    before the target loads; nothing is written (was: an ArrowInvalid traceback)."""
    f = tmp_path / "chats.parquet"
    _parquet(f, range(6))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "out"))
    assert code == 2 and f"{f} is not a readable parquet file" in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_unfinished_prepare_with_a_cut_shard(tmp_path, tiny_llama_dir):
    """An unfinished prepare (no manifest yet) one of whose shards was cut in half, resumed: the shard is
    named and encoded again, and the dataset equals an uninterrupted one (was: a traceback not naming
    the shard)."""
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps(_conv(i)) + "\n" for i in range(6)))
    out = tmp_path / "out"
    args = _prepare_args(tiny_llama_dir, f, out, "--chunk-size", "2")
    assert eyas(*args)[0] == 0
    done = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").unlink()  # as a run stopped before its last step leaves it
    (out / ".prepare-state.json").write_text(json.dumps(done["settings"]))
    shard = out / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, msg = eyas(*args)
    assert code == 0, msg
    assert json.loads((out / "manifest.json").read_text())["id"] == done["id"]


def test_bad_input_duplicate_conversations(tmp_path, tiny_llama_dir):
    """A JSONL of 6 conversations plus 2 exact repeats: `eyas prepare` keeps them and says how many, with
    an example and `--dedupe`; with `--dedupe` they are dropped and counted as "duplicate" (was: kept
    silently)."""
    from eyas.data.prepare import summary_lines

    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps(_conv(i)) + "\n" for i in [0, 1, 2, 3, 1, 4, 5, 3]))
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "kept"))
    m = json.loads((tmp_path / "kept" / "manifest.json").read_text())
    assert code == 0 and m["counts"]["samples"] == 8 and m["counts"]["duplicates"] == 2
    line = next(x for x in summary_lines(m) if "duplicates" in x)
    assert "kept 2 duplicates" in line and f"{f}:5 repeats {f}:2" in line and "--dedupe" in line
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "dedup", "--dedupe"))
    m = json.loads((tmp_path / "dedup" / "manifest.json").read_text())
    assert code == 0 and m["counts"]["samples"] == 6 and m["counts"]["dropped"] == {"duplicate": 2}


# ----------------------------------------------------------------------- what manifests name


@pytest.mark.parametrize("name", ["../d12/shard-00000.parquet", "/etc/passwd"], ids=["dotdot", "absolute"])
def test_bad_input_prepared_manifest_names_a_file_outside(tmp_path, tiny_target, train_data, name):
    """A prepared manifest whose shard is `../d12/shard-00000.parquet` (another dataset's) or `/etc/passwd`,
    given to `eyas extract`: exit 2 naming the entry as no plain file name of the folder; nothing
    outside it is read (was: followed, extract exit 0 with another dataset's rows under this one's id)."""
    import shutil

    d = tmp_path / "d"
    shutil.copytree(train_data, d)
    (tmp_path / "d12").mkdir()
    shutil.copy(d / "shard-00000.parquet", tmp_path / "d12")
    m = json.loads((d / "manifest.json").read_text())
    m["shards"][0]["file"] = name
    (d / "manifest.json").write_text(json.dumps(m))
    code, msg = eyas(
        "extract",
        "--target",
        tiny_target.path,
        "--data",
        d,
        "--out",
        tmp_path / "st",
        "--layers",
        "1,4,6",
        "--device",
        "cpu",
    )
    assert code == 2 and f"names the file {name!r}, which is not a plain file name inside that folder" in msg
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd"], ids=["dotdot", "absolute"])
def test_bad_input_store_manifest_names_a_file_outside(tmp_path, tiny_target, train_data, store, name):
    """A store manifest whose first shard is `../../../../etc/passwd` or `/etc/passwd`: `eyas extract
    --verify` names the entry (exit 1) and training stops at the store's opening naming it; the file is
    never opened (was: opened, and train called it "shard-000000 is corrupt")."""
    import test_train_run
    from eyas.manifest import read_manifest, write_manifest
    from eyas.train.trainer import run as train

    m = read_manifest(store)
    m["shards"][0]["file"] = name
    write_manifest(store, m)
    code, out = eyas("extract", "--verify", store)
    # the console wraps long lines where the temporary folder's length puts them
    assert code == 1 and f"names the file {name!r}, which is not a plain file name" in " ".join(out.split())
    cfg = test_train_run._cfg(
        tiny_target, train_data, tmp_path / "run", features="offline", store=str(store), max_steps=2, eval_every=0
    )
    with pytest.raises(EyasError, match="not a plain file name inside that folder"):
        train(cfg)


# ------------------------------------------------------------------------------- the target


def test_bad_input_target_weights_damaged_in_place(tmp_path, tiny_llama_dir, train_data):
    """1 KB flipped inside a target's model.safetensors between the values its identity samples (same
    size, the old mtime put back): `eyas extract` exits 2 naming the file and its changed checksum,
    nothing extracted (was: exit 0, garbage states under the unchanged target id)."""
    import shutil

    from eyas.features.format import read_header
    from eyas.target import _weights_fingerprint, resolve_target

    tgt = tmp_path / "target"
    shutil.copytree(tiny_llama_dir, tgt, ignore=shutil.ignore_patterns(".eyas*"))
    before = resolve_target(tgt).identity  # the first use records the weight files' checksums
    f = tgt / "model.safetensors"
    st = f.stat()
    start, header = read_header(f)
    big = max(
        (v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1] - v["data_offsets"][0]
    )
    at = start + big["data_offsets"][0] + 64  # after the tensor's first sampled value, well before its second
    with open(f, "r+b") as fh:
        fh.seek(at)
        chunk = fh.read(1024)
        fh.seek(at)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _weights_fingerprint(tgt)[:16] == before["weights"]  # the sampled identity does not see it
    code, msg = eyas(
        "extract",
        "--target",
        tgt,
        "--data",
        train_data,
        "--out",
        tmp_path / "st",
        "--layers",
        "1,4,6",
        "--device",
        "cpu",
    )
    assert code == 2 and "weight file model.safetensors (checksum" in msg
    assert "changed since eyas recorded it" in msg and "damaged" in msg
    assert not (tmp_path / "st").exists()


def test_bad_input_gguf_cut_off(tmp_path):
    """A `.gguf` target cut off after its first bytes: exit 2 naming the file as cut off or damaged, and
    nothing kept of the conversion (was: a struct.error traceback)."""
    from eyas.target import resolve_target

    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(EyasError, match=r"the GGUF file cannot be read .* cut off or damaged"):
        resolve_target(f, cache=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("config.json"))


# ------------------------------------------------------------------------------------ drafts


@pytest.mark.parametrize(
    "field, value, stage",
    [
        ("intermediate_size", 2_000_000_000, "export_with_target"),
        ("intermediate_size", 2_000_000_000, "export"),
        ("draft_vocab_size", 60_000, "export"),
        ("intermediate_size", 2_000_000_000, "evaluate"),
    ],
    ids=[
        "intermediate_2e9_export_target",
        "intermediate_2e9_export",
        "draft_vocab_60000_export",
        "intermediate_2e9_evaluate",
    ],
)
def test_bad_input_draft_config_does_not_fit_weights(tmp_path, export_target, field, value, stage):
    """A draft whose config.json does not fit its weights (`intermediate_size` 2e9 over weights 256 wide,
    `draft_vocab_size` 60,000 over 200 rows), exported with or without `--target`, or evaluated: exit 2
    naming the tensor, both shapes and the field, before any tensor is loaded or allocated (was: exit 0
    with the config's value in the vLLM config, or a 4.6 TB allocation)."""
    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg[field] = value
    (draft / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    if stage.startswith("export"):
        args = ["export", draft, "--out", out, *(["--target", export_target.path] if "target" in stage else [])]
    else:
        args = [
            "evaluate",
            "--draft",
            draft,
            "--target",
            export_target.path,
            "--out",
            out,
            "--max-new-tokens",
            "4",
            "--device",
            "cpu",
        ]
    code, msg = eyas(*args)
    assert code == 2 and "config.json does not fit model.safetensors" in msg and f"{field}={value}" in msg
    assert not out.exists()


def _rewrite_header(f: Path, edit) -> None:
    """Rewrite the safetensors header of ``f`` through ``edit(header) -> header | bytes``."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8 : 8 + n]))
    data = raw[8 + n :]
    if isinstance(header, bytes):  # a raw length prefix: the header as it claims to be
        f.write_bytes(header + raw[8:])
        return
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _offsets_past_end(h: dict) -> dict:
    h["fc.weight"]["data_offsets"][1] += 1 << 30
    return h


def _overlapping(h: dict) -> dict:
    a, b = h["norm.weight"]["data_offsets"]
    c, _ = h["fc.weight"]["data_offsets"]
    h["norm.weight"]["data_offsets"] = [c, c + b - a]  # norm now lies on top of fc
    return h


@pytest.mark.parametrize(
    "damage, match",
    [
        ("cut", "it is cut off, damaged or not a safetensors file"),
        ("huge_header", "its header claims 1,099,511,627,776 bytes"),
        ("offsets_past_end", "tensor 'fc.weight' spans bytes"),
        ("overlapping", "overlap"),
    ],
    ids=["cut_in_half", "header_length_1tb", "offsets_past_the_end", "overlapping_tensors"],
)
def test_bad_input_draft_weights_damaged(tmp_path, export_target, damage, match):
    """A draft's model.safetensors cut in half, with a header length of 1 TB, a tensor's offsets past the
    end, or two tensors' bytes overlapping, to `eyas export`: exit 2 naming the file and what is wrong
    with it, before anything is allocated (was: a SafetensorError traceback, or an allocation of the
    claimed size)."""
    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    f = draft / "model.safetensors"
    if damage == "cut":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "huge_header":
        _rewrite_header(f, lambda h: (1 << 40).to_bytes(8, "little"))
    else:
        _rewrite_header(f, {"offsets_past_end": _offsets_past_end, "overlapping": _overlapping}[damage])
    code, msg = eyas("export", draft, "--out", tmp_path / "out")
    assert code == 2 and str(f) in msg and match in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_evaluate_draft_cut_off(tmp_path, export_target):
    """A draft's model.safetensors cut in half, to `eyas evaluate`: exit 2 naming the file, before the
    target runs (was: a traceback)."""
    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    f = draft / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, msg = eyas(
        "evaluate", "--draft", draft, "--target", export_target.path, "--out", tmp_path / "out", "--device", "cpu"
    )
    assert code == 2 and str(f) in msg and "cut off, damaged or not a safetensors file" in msg


@pytest.mark.parametrize(
    "value, match",
    [
        ("abc", "intermediate_size = 'abc' is not an integer"),
        ("-5", "intermediate_size = -5 must be >= 1"),
    ],
    ids=["abc", "minus_5"],
)
def test_bad_input_train_draft_config_value(tmp_path, tiny_target, train_data, value, match):
    """`eyas train --draft-config intermediate_size=abc` or `=-5`: exit 2 naming the field and the value
    (was: a TypeError or RuntimeError traceback from building the layer)."""
    code, msg = eyas(
        "train",
        "--target",
        tiny_target.path,
        "--data",
        train_data,
        "--out",
        tmp_path / "run",
        "--online",
        "--layers",
        "1,4,6",
        "--max-steps",
        "1",
        "--draft-config",
        f"intermediate_size={value}",
        "--quiet",
    )
    assert code == 2 and match in msg


def test_bad_input_export_overwrite_of_a_folder_that_is_not_an_export(tmp_path, export_target):
    """`eyas export DRAFT --out X --overwrite` where X is a folder of other files (not an earlier export):
    exit 2 saying --overwrite replaces only an export; every file intact (was: the folder deleted)."""
    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    code, msg = eyas("export", draft, "--out", out, "--overwrite")
    assert code == 2 and f"--out {out} exists and is not an eyas export" in msg
    assert (out / "cat.jpg").read_bytes() == b"\xff\xd8 a cat"
    assert eyas("export", draft, "--out", tmp_path / "exp")[0] == 0
    assert eyas("export", draft, "--out", tmp_path / "exp", "--overwrite")[0] == 0  # an export it replaces


def test_bad_input_export_readable_by_others_under_umask_022(tmp_path, export_target):
    """`eyas export` under umask 022: the export folder 0755 and its files 0644, as any file the user
    writes, so that the user who serves it can read it (was: 0700 and 0600)."""
    import stat

    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    old = os.umask(0o022)
    try:
        assert eyas("export", draft, "--out", tmp_path / "exp")[0] == 0
    finally:
        os.umask(old)
    exp = tmp_path / "exp"
    assert stat.S_IMODE(exp.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in exp.iterdir()} == {0o644}


# ------------------------------------------------------------------------------------ train


def test_bad_input_checkpoint_trainer_state_step_edited(tmp_path, tiny_target, train_data, finished_run, capfd):
    """`trainer_state.json` of the latest checkpoint edited to step 10^9, `--resume`: the file is named,
    the checkpoint moved aside, and training resumes from the previous one to the same draft and
    summary (was: exit 0 with the step-2 draft and a summary of 6 steps)."""
    import torch

    run = _copy_run(finished_run, tmp_path)
    f = run / "checkpoints" / "step-00000004" / "trainer_state.json"
    state = json.loads(f.read_text())
    state["step"] = 10**9
    f.write_text(json.dumps(state))
    want = _draft_weights(finished_run)
    _resume(tiny_target, train_data, run)
    err = capfd.readouterr().err
    assert f"checkpoint step-00000004 is unreadable ({f}: says step 1000000000" in err
    assert "step-00000002" in err
    got = _draft_weights(run)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize(
    "file, key, value, match",
    [
        ("trainer_state.json", "step", "abc", "step 'abc' is not a step number"),
        ("trainer_state.json", "step", 2, "says step 2, but it is the checkpoint of step 4"),
        ("config.json", "intermediate_size", 999, "config.json does not fit it: midlayer.mlp"),
    ],
    ids=["step_abc", "step_of_another_checkpoint", "config_intermediate_999"],
)
def test_bad_input_checkpoint_does_not_match_its_own_record(tmp_path, finished_run, file, key, value, match):
    """A checkpoint whose trainer_state.json says another step ("abc", or an earlier checkpoint's) or
    whose config.json does not fit its weights (`intermediate_size` 999 over weights 128 wide): refused
    as unreadable naming the file, so `--resume` moves it aside and resumes from the previous one (was:
    a ValueError or size-mismatch traceback, or the wrong step resumed)."""
    from eyas.train import checkpoint as ckpt

    run = _copy_run(finished_run, tmp_path)
    c = run / "checkpoints" / "step-00000004"
    data = json.loads((c / file).read_text())
    data[key] = value
    (c / file).write_text(json.dumps(data))
    with pytest.raises(ckpt.Unreadable, match=match):
        ckpt.load(c, 0)
    ckpt.load(run / "checkpoints" / "step-00000002", 0)  # the previous one reads back


def test_bad_input_finished_run_resumed_with_fewer_max_steps(finished_run):
    """A finished 4-step run resumed with `--max-steps 2` (`checkpoint.check_resume_step`, which the trainer
    calls once it knows its planned steps): refused naming the checkpoint's step, the planned steps and
    what to do (was: exit 0, the later step's draft written with a summary of the fewer steps)."""
    from eyas.train import checkpoint as ckpt

    resumed = ckpt.load_latest(finished_run, 0)
    with pytest.raises(EyasError, match=r"step-00000004: it is at step 4, past the 2 steps this run plans"):
        ckpt.check_resume_step(resumed, 2)
    ckpt.check_resume_step(resumed, 4)  # the same plan: a no-op resume


def test_bad_input_train_resume_without_a_checkpoint(tmp_path):
    """`eyas train --resume` into a --out that holds no checkpoint: a warning naming the folder and saying
    training starts at step 0 (was: silently trained from scratch)."""
    code, msg = eyas(*_train_args(tmp_path, "--resume"))
    assert f"--resume: {tmp_path / 'run'} holds no checkpoint" in msg and "starts at step 0" in msg


def test_bad_input_pipeline_layers_out_of_range(tmp_path, tiny_llama_dir):
    """Pipeline `train.layers: [2, 2, 99]` for an 8-layer target: exit 2 naming the key and the ids out of
    range before prepare runs (was: found only after prepare and extract, with the wrong reason)."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"target: {tiny_llama_dir}\nworkdir: {tmp_path / 'work'}\ntrain:\n  layers: [2, 2, 99]\n")
    code, msg = eyas("pipeline", cfg)
    assert code == 2 and "train.layers = [2, 2, 99]: layer ids [99] out of range" in msg
    assert not (tmp_path / "work" / "prepared").exists()


def test_bad_input_six_layer_target_default_layers():
    """A 6-layer target with no --layers given: distinct default aux ids spread over its layers (was:
    refused for the default ids [2, 3, 3] the user never gave)."""
    from eyas.features.layers import resolve_layers

    assert resolve_layers(6) == ([1, 2, 4], 6)
    assert resolve_layers(32) == ([2, 16, 29], 32)  # deep targets keep EAGLE-3's choice


# --------------------------------------------------------------------------------- evaluate


def test_bad_input_evaluate_k_more_than_max_new_tokens(tmp_path):
    """`eyas evaluate -k 1000 --max-new-tokens 8`, and the same in a pipeline config: exit 2 before any
    model loads, saying k is more than the tokens a turn generates (was: nothing recorded in 300 s)."""
    code, msg = eyas(
        "evaluate",
        "--draft",
        tmp_path / "draft",
        "--target",
        tmp_path / "no-target",
        "-k",
        "1000",
        "--max-new-tokens",
        "8",
    )
    assert code == 2 and "-k 1000 is more than --max-new-tokens 8" in msg
    code, msg = eyas("pipeline", _yaml(tmp_path, "evaluate:\n  k: 1000\n  max_new_tokens: 8\n"))
    assert code == 2 and "evaluate.k 1000 is more than evaluate.max_new_tokens 8" in msg
    assert not (tmp_path / "work").exists()


def test_bad_input_prompts_file_rewritten_in_place(tmp_path, export_target):
    """The prompts file of `eyas evaluate` rewritten in place (same path, other questions) and evaluated
    again into the same --out: exit 2 naming prompts_sha256, the earlier records untouched (was: exit 0,
    the old answers reused and the report rebuilt from them)."""
    import evalkit
    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    prompts = evalkit.write_questions(tmp_path / "question.jsonl", 1, turns=1)
    args = [
        "evaluate",
        "--draft",
        draft,
        "--target",
        export_target.path,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "ev",
        "-k",
        "2",
        "--max-new-tokens",
        "4",
        "--no-plain",
        "--device",
        "cpu",
        "--quiet",
    ]
    code, msg = eyas(*args)
    assert code == 0, msg
    records = tmp_path / "ev" / "builtin" / "records.jsonl"
    before = records.read_bytes()
    evalkit.write_questions(prompts, 1, seed=1, turns=1)
    code, msg = eyas(*args)
    assert code == 2 and "prompts_sha256" in msg
    assert records.read_bytes() == before


# ------------------------------------------------------------------------- config, CLI, help


def test_bad_input_config_yaml_alias_bomb(tmp_path):
    """A pipeline config whose aliases under `prepare.data` expand to 3.5 billion values (ten levels of
    nine aliases): exit 2 within seconds saying the aliases expand past the limit, nothing run (was: 93 s
    of CPU, then a MemoryError at a 6 GB ulimit; without one it can take the machine)."""
    import time

    levels = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    cfg = _yaml(tmp_path, "prepare:\n  data: [" + ", ".join(levels) + "]\n")
    t = time.perf_counter()
    code, msg = eyas("pipeline", cfg)
    assert code == 2 and "its aliases (*name) expand to more than 100,000 values" in msg
    assert time.perf_counter() - t < 10
    assert not (tmp_path / "work").exists()


def test_bad_input_extract_data_is_a_conversations_file(tmp_path, tiny_target):
    """`eyas extract --data chats.jsonl` (conversations, not a prepared folder): exit 2 saying it is the
    input of `eyas prepare --data` (was: advice to run `eyas prepare --out chats.jsonl`)."""
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps(_conv(0)) + "\n")
    code, msg = eyas("extract", "--target", tiny_target.path, "--data", f, "--out", tmp_path / "st")
    assert code == 2 and f"eyas prepare --data {f} --out DIR" in msg and f"--out {f}`" not in msg


def test_bad_input_extract_out_is_its_data(tmp_path, tiny_target, train_data):
    """`eyas extract --out` equal to its `--data`: exit 2 saying --out is the prepared dataset, the dataset
    untouched (was: a 10-field settings diff)."""
    before = _snapshot(train_data)
    code, msg = eyas("extract", "--target", tiny_target.path, "--data", train_data, "--out", train_data)
    assert code == 2 and f"--out {train_data} is the prepared dataset --data" in msg
    assert _snapshot(train_data) == before


def test_bad_input_train_help_keeps_brackets():
    """`eyas train --help`: "[tokens, vocab]" in the --fused-loss help is printed as written (was: eaten
    as rich markup)."""
    from eyas.cli import app

    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0 and "no [tokens, vocab] tensors kept" in res.output


def test_bad_input_unexpected_error_is_one_line(tmp_path, monkeypatch, capsys):
    """An error eyas does not foresee (here an export that fails with a RuntimeError) as the `eyas`
    command ends in it: one line naming it and saying to re-run with --debug, exit 1, no traceback;
    with `--debug` the traceback too (was: a traceback always)."""
    from eyas.cli import main
    from eyas.export import run

    def boom(cfg, torch_dtype):
        raise RuntimeError("boom")

    monkeypatch.setattr(run, "_export", boom)
    monkeypatch.delenv("EYAS_DEBUG", raising=False)
    for debug in ([], ["--debug"]):
        with pytest.raises(SystemExit) as e:
            main([*debug, "export", str(tmp_path / "draft"), "--out", str(tmp_path / "exp")])
        err = capsys.readouterr().err
        assert e.value.code == 1 and "unexpected RuntimeError: boom" in err and "--debug" in err
        assert ("Traceback" in err) == bool(debug)
    monkeypatch.delenv("EYAS_DEBUG", raising=False)


def test_bad_input_disk_full_is_one_line():
    """A write that finds the disk full (here /dev/full) as the `eyas` command reports it: one line
    naming the file, the cause and that a re-run resumes (was: an ENOSPC traceback)."""
    from eyas.cli import error_line

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with pytest.raises(OSError) as e:
        with open("/dev/full", "w") as fh:
            fh.write("x")
    e.value.filename = "/data/store/shard-000007.safetensors"
    line, code = error_line(e.value)
    assert code == 2 and line.startswith("no space left on the device holding /data/store/shard-000007")
    assert "re-run the same command; it resumes" in line


def test_bad_input_evaluate_prompt_longer_than_the_context(tmp_path, export_target):
    """An evaluate prompts file with a 700-token question for a target of 512 positions: a warning naming
    the question, its tokens and the target's context before it runs (was: it ran with no warning)."""
    import test_export

    draft = test_export._draft(export_target, tmp_path / "draft")
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 7, "category": "writing", "turns": ["the lazy dog " * 230]}) + "\n")
    code, msg = eyas(
        "evaluate",
        "--draft",
        draft,
        "--target",
        export_target.path,
        "--prompts",
        q,
        "--out",
        tmp_path / "ev",
        "-k",
        "2",
        "--max-new-tokens",
        "2",
        "--no-plain",
        "--device",
        "cpu",
        "--quiet",
    )
    assert code == 0, msg
    assert "exceeds the target's context of 512 tokens" in msg and "question 7:" in msg


# ------------------------------------------------------------------- outputs of a pre-release eyas


def _with_embedding(folder: Path, target_dir: Path) -> None:
    """``folder``'s model.safetensors with the target's embedding added, as a pre-release eyas saved it."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(target_dir / "model.safetensors"), "pt") as fh:
        embed = fh.get_tensor("model.embed_tokens.weight").float()
    w = load_file(str(folder / "model.safetensors"))
    save_file({**w, "embed_tokens.weight": embed}, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "output, match",
    [
        ("draft", "holds the target's embedding (embed_tokens.weight), which only a pre-release eyas saved"),
        ("checkpoint", "holds the target's embedding (embed_tokens.weight), which only a pre-release eyas saved"),
        ("store", "its manifest has no scale record, so a pre-release eyas wrote it"),
        ("pipeline_record", "no stage records with their status and time, so a pre-release eyas wrote it"),
    ],
    ids=[
        "draft_holding_the_target_embedding",
        "checkpoints_holding_the_target_embedding",
        "store_from_before_fp8",
        "pipeline_record_with_sections_only",
    ],
)
def test_bad_input_output_of_a_pre_release_eyas(tmp_path, request, output, match):
    """An output of a pre-release eyas (a draft or checkpoints holding the target's embedding, a store
    from before fp8 stores without a scale record, a pipeline-config.json of sections only) exported,
    resumed, read or run again: exit 2 (or the error) naming the file, saying that a pre-release eyas
    wrote it and what to do (was: each read, resumed or derived as it was)."""
    if output == "draft":
        import test_export

        target = request.getfixturevalue("export_target")
        draft = test_export._draft(target, tmp_path / "draft")
        _with_embedding(draft, target.path)
        code, msg = eyas("export", draft, "--out", tmp_path / "out")
        assert code == 2 and str(draft / "model.safetensors") in msg and match in msg
        assert not (tmp_path / "out").exists()
    elif output == "checkpoint":
        from eyas.train.checkpoint import checkpoint_dirs

        tiny_target, train_data = request.getfixturevalue("tiny_target"), request.getfixturevalue("train_data")
        run = _copy_run(request.getfixturevalue("finished_run"), tmp_path)
        for ck in checkpoint_dirs(run):
            _with_embedding(ck, tiny_target.path)
        with pytest.raises(
            EyasError,
            match=r"no checkpoint .* can be read: .*step-00000004/model.safetensors: "
            rf".*{re.escape(match)}.*Start again with a new --out",
        ):
            _resume(tiny_target, train_data, run)
    elif output == "store":
        import torch

        from eyas.features.reader import open_store
        from eyas.features.verify import verify_store
        from eyas.features.writer import StoreWriter

        st = tmp_path / "store"
        fields = {
            "target": {"id": "fixture"},
            "aux_layers": [1, 2],
            "final_layer": 4,
            "convention": "vllm-input-of-layer",
            "dtype": "bf16",
            "hidden_size": 8,
            "num_samples": 2,
        }
        w = StoreWriter(st, fields, shard_tokens=5, num_writers=1)
        for i in range(2):
            s = torch.randn(4, 3, 8)
            w.add(i, torch.arange(4), torch.ones(4, dtype=torch.bool), s[:, :2], s[:, 2])
        w.close()
        for f in [st / "manifest.json", *st.glob("shard-*.json")]:  # as the stores before fp8 were
            m = json.loads(f.read_text())
            m.pop("scale", None), m.pop("tensor_checksums", None)
            for sh in m.get("shards", []):
                sh.pop("tensor_checksums")
            f.write_text(json.dumps(m))
        for read in (open_store, lambda p: StoreWriter(p, fields)):
            with pytest.raises(EyasError, match=re.escape(f"store {st}: {match}") + ".*extract it again"):
                read(st)
        assert any(match in p for p in verify_store(st))
    else:
        from eyas.config import load_config

        config = _pipeline(tmp_path, request.getfixturevalue("tiny_llama_dir"))
        work = load_config(config).workdir
        work.mkdir(parents=True)
        record = work / "pipeline-config.json"
        record.write_text(json.dumps({"target": "x", "sections": {"train": {"max_steps": 3}}}))
        code, msg = eyas("pipeline", config)
        assert code == 2 and f"{record}: {match}" in msg and "Use a new workdir" in msg
        assert sorted(p.name for p in work.iterdir()) == ["pipeline-config.json"]
