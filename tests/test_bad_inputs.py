"""Bad inputs and faults, one test each, named ``test_bad_input_<what>``: every one ends in a named
error (exit 2, a message saying what to change) or the documented recovery, and no input is lost.

The docstring of each test is its row in benchmarks/reliability.md (scripts/reliability_table.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.errors import EyasError


def _conv(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}: the quick brown fox?"},
                                             {"from": "gpt", "value": f"answer {i}: the lazy dog."}]}


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
    return ["prepare", "--target", str(target), "--data", str(data), "--out", str(out),
            "--draft-vocab-size", "40", "--max-length", "256", "--workers", "1", "--quiet", *extra]


def test_bad_input_json_missing_comma(tmp_path, tiny_llama_dir):
    """`.json` array of 40 items with one missing comma: exit 2 naming the file, the byte offset and
    the reason; nothing is written."""
    text = json.dumps([_conv(i) for i in range(40)])
    at = text.index("}, {", len(text) // 3)
    bad = text[:at + 1] + text[at + 2:]  # drop one comma between two items
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
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772": "sharegpt"}
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


@pytest.mark.parametrize("text, match", [
    ("train:\n  lr: fast\n", "train.lr = 'fast' is a string; expected a number"),
    ("train:\n  compile: 'yes'\n", "train.compile = 'yes' is a string; expected true or false"),
    ("train:\n  layers: 2,3\n", "train.layers = '2,3' is a string; expected a list of integers"),
    ("evaluate:\n  k: 2.5\n", "evaluate.k = 2.5 is a number; expected an integer"),
    ("prepare:\n  regenerate:\n    top_p: high\n", "prepare.regenerate.top_p = 'high' is a string"),
], ids=["lr_fast", "compile_yes_string", "layers_string", "k_2.5", "regenerate_top_p_high"])
def test_bad_input_config_value_of_the_wrong_type(tmp_path, text, match):
    """A YAML value of the wrong type: exit 2 naming the key, the value and the expected type,
    before any stage runs."""
    code, msg = eyas("pipeline", _yaml(tmp_path, text))
    assert code == 2 and match in msg
    assert not (tmp_path / "work").exists()


# ----------------------------------------------------------------------------- settings: ranges


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    # the target does not exist: a range error must come before anything is loaded
    return ["train", "--target", str(tmp_path / "no-such-target"), "--data", str(tmp_path / "d"),
            "--out", str(tmp_path / "run"), "--online", *extra]


@pytest.mark.parametrize("flag, value, match", [
    ("--ttt-steps", "0", "--ttt-steps 0 (training-time-test steps unrolled) must be >= 1"),
    ("--tokens-per-batch", "1", "--tokens-per-batch 1 (tokens per pack) must be >= 3"),
    ("--lr", "-0.001", "--lr -0.001 (peak learning rate) must be > 0"),
    ("--lr", "0", "--lr 0.0 (peak learning rate) must be > 0"),
    ("--max-steps", "0", "--max-steps 0 (optimizer steps) must be >= 1"),
    ("--heldout", "1", "--heldout 1.0 (fraction of samples held out) must be < 1"),
    ("--grad-accum", "0", "--grad-accum 0 (micro-batches per optimizer step) must be >= 1"),
    ("--eval-batches", "0", "--eval-batches 0"),
    ("--warmup", "-1", "--warmup -1 (warmup steps) must be >= 0"),
], ids=["ttt_steps_0", "tokens_per_batch_1", "lr_negative", "lr_0", "max_steps_0", "heldout_1",
        "grad_accum_0", "eval_batches_0", "warmup_negative"])
def test_bad_input_train_flag_out_of_range(tmp_path, flag, value, match):
    """`eyas train` with a numeric flag out of range: exit 2 naming the flag, the value and the
    allowed range before the target loads (was: an autograd/torch traceback after it loaded, or a
    silent run)."""
    code, msg = eyas(*_train_args(tmp_path, flag, value))
    assert code == 2 and match in msg and "change it" in msg
    assert not (tmp_path / "run").exists()


def test_bad_input_config_train_ttt_steps_0(tmp_path):
    """YAML `train: {ttt_steps: 0}`: the same range check as the flag, before prepare runs."""
    code, msg = eyas("pipeline", _yaml(tmp_path, "train:\n  ttt_steps: 0\n"))
    assert code == 2 and "train.ttt_steps = 0 (training-time-test steps unrolled) must be >= 1" in msg
    assert not (tmp_path / "work").exists()


def test_bad_input_evaluate_max_new_tokens_0(tmp_path):
    """`eyas evaluate --max-new-tokens 0`: exit 2 before any model loads (was: "tau n/a", exit 0)."""
    code, msg = eyas("evaluate", "--draft", tmp_path / "draft", "--target", tmp_path / "no-target",
                     "--max-new-tokens", "0")
    assert code == 2 and "--max-new-tokens 0 (tokens generated per turn) must be >= 1" in msg


def test_bad_input_evaluate_replay_with_sampling(tmp_path):
    """`eyas evaluate --engine replay --temperature 0.7`: exit 2 before any model loads; replay reads
    greedy acceptance only (with sampling the output depends on the draft)."""
    code, msg = eyas("evaluate", "--draft", tmp_path / "draft", "--target", tmp_path / "no-target",
                     "--engine", "replay", "--temperature", "0.7")
    assert code == 2 and "replay measures greedy acceptance only" in msg and "--engine builtin or vllm" in msg


@pytest.mark.parametrize("text, match", [
    ("evaluate:\n  max_new_tokens: 0\n", "evaluate.max_new_tokens = 0"),
    ("export:\n  num_speculative_tokens: 0\n", "export.num_speculative_tokens = 0"),
    ("prepare:\n  max_length: 1\n", "prepare.max_length = 1"),
    ("prepare:\n  regenerate:\n    temperature: -1\n", "prepare.regenerate.temperature = -1"),
    ("extract:\n  batch_tokens: 0\n", "extract.batch_tokens = 0"),
], ids=["evaluate_max_new_tokens_0", "export_k_0", "prepare_max_length_1",
        "regenerate_temperature_negative", "extract_batch_tokens_0"])
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
    out = {"draft": draft, "run_dir": run, "inside_draft": draft / "vllm",
           "target": export_target.path}[where]
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
    from eyas.train.trainer import train

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
    from eyas.train.trainer import train

    return train(test_train_run._cfg(tiny_target, train_data, run, keep_checkpoints=3, eval_every=0,
                                     resume=True))


def _draft_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "draft" / "model.safetensors"))


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.json"])
def test_bad_input_checkpoint_latest_file_truncated(tmp_path, tiny_target, train_data, finished_run,
                                                    capfd, name):
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


def test_bad_input_checkpoint_pickle_payload_in_optimizer_pt(tmp_path, tiny_target, train_data, finished_run,
                                                             capfd):
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


def test_bad_input_checkpoint_pickle_payload_in_old_rng_file(tmp_path, finished_run):
    """A checkpoint in the old layout (rng-0.pt, a torch.save pickle): loads with weights_only=True and
    numpy's array types allowed; one whose rng-0.pt carries a code-running payload is refused, unrun."""
    import torch

    from eyas.train import checkpoint as ckpt

    run = _copy_run(finished_run, tmp_path)
    c = run / "checkpoints" / "step-00000004"
    state = ckpt.load(c, 0)["rng"]
    (c / "rng-0.json").unlink()
    torch.save(ckpt.rng_from_json(ckpt.rng_to_json(state)), c / "rng-0.pt")  # what old eyas wrote
    old = ckpt.load(c, 0)["rng"]
    assert torch.equal(old["torch"], state["torch"]) and old["python"] == state["python"]
    assert (old["numpy"][1] == state["numpy"][1]).all()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"torch": Payload()}, c / "rng-0.pt")
    with pytest.raises(ckpt.Unreadable, match="rng-0.pt: UnpicklingError"):
        ckpt.load(c, 0)
    assert not marker.exists()


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
    from eyas.extract.run import run_extract

    run_extract(str(tiny_target.path), train_data, out, [1, 4, 6], dtype=dtype, device="cpu",
                batch_tokens=400, progress=False)
    return out


@pytest.fixture
def store(tmp_path, tiny_target, train_data) -> Path:
    return _extract(tmp_path / "store", tiny_target, train_data, "fp32")


def test_bad_input_store_shard_flipped_byte_stops_training(tmp_path, tiny_target, train_data, store):
    """Training on a store one of whose shards has a flipped byte: stops at the shard's first read,
    naming the shard and the `eyas extract` re-run that rewrites it (was: trained to the end, silent)."""
    import test_train_run
    from eyas.train.trainer import train

    bad = sorted(store.glob("shard-*.safetensors"))[1]
    _flip_a_byte(bad)
    cfg = test_train_run._cfg(tiny_target, train_data, tmp_path / "run", online=False, store=str(store),
                              max_steps=6, eval_every=0)
    with pytest.raises(EyasError) as e:
        train(cfg)
    msg = str(e.value)
    assert f"{bad.name} is corrupt (checksum" in msg
    assert f"eyas extract --data {train_data.resolve()} --out {store}" in msg


def test_bad_input_store_shard_flipped_byte_rewritten_by_extract_rerun(tmp_path, tiny_target, train_data,
                                                                      store, capfd):
    """`eyas extract` re-run over a complete store with a flipped byte in one shard: the shard is
    re-checked, named and extracted again, and the store verifies clean (was: "already there")."""
    from eyas.extract.run import run_extract
    from eyas.features.verify import verify_store

    bad = sorted(store.glob("shard-*.safetensors"))[1]
    _flip_a_byte(bad)
    assert verify_store(store)
    s = run_extract(str(tiny_target.path), train_data, store, [1, 4, 6], dtype="fp32", device="cpu",
                    batch_tokens=400, progress=False)
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
    from eyas.train.trainer import train

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
    cfg = test_train_run._cfg(tiny_target, train_data, tmp_path / "run", online=False, store=str(fp8_store),
                              layers=None, max_steps=6, eval_every=0)
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
    from eyas.train.trainer import train

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
    assert problems == [f"{bad.name}: tensor hidden_scale: 1 scale(s) non-finite or negative (first at "
                        "token 2, slot 1: nan); every value of such a group decodes wrong"]
    cfg = test_train_run._cfg(tiny_target, train_data, tmp_path / "run", online=False, store=str(fp8_store),
                              layers=None, max_steps=6, eval_every=0)
    with pytest.raises(EyasError, match=f"{bad.name} is corrupt \\(tensor hidden_scale: 1 scale"):
        train(cfg)


@pytest.mark.parametrize("first, again, match", [
    (["--dtype", "bf16"], ["--dtype", "fp8"], "dtype: 'bf16' in the store, 'fp8' now"),
    (["--dtype", "fp8"], ["--dtype", "fp8", "--fp8-group-size", "16"], "scale: .*'groups': 1.* in the store"),
], ids=["bf16_store_resumed_as_fp8", "fp8_store_resumed_with_other_scales"])
def test_bad_input_store_resumed_with_another_dtype(tmp_path, tiny_target, train_data, first, again, match):
    """`eyas extract` into an existing store with another --dtype or fp8 scale layout: exit 2 naming
    the field, its value in the store and now; the store is untouched."""
    st = tmp_path / "st"
    args = ["extract", "--target", tiny_target.path, "--data", train_data, "--out", st, "--layers", "1,4,6",
            "--device", "cpu"]
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
    from eyas.extract.run import run_extract

    st = tmp_path / "st"
    args = ["extract", "--target", tiny_target.path, "--data", train_data, "--out", st, "--layers", "1,4,6",
            "--device", "cpu"]
    plan = run_extract(str(tiny_target.path), train_data, st, [1, 4, 6], device="cpu", plan_only=True)["plan"]
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


def test_bad_input_pipeline_record_from_an_older_eyas(tmp_path, tiny_llama_dir):
    """A workdir whose pipeline-config.json was written by an older eyas (sections only, no stage
    fingerprints): its sections are taken as the record, so changed train settings are refused too."""
    from eyas.config import load_config
    from eyas.pipeline import run_pipeline

    run_pipeline(load_config(_pipeline(tmp_path, tiny_llama_dir)))
    rec_path = tmp_path / "run" / "pipeline-config.json"
    rec = json.loads(rec_path.read_text())
    del rec["stages"]
    rec_path.write_text(json.dumps(rec))
    run_pipeline(load_config(_pipeline(tmp_path, tiny_llama_dir)))  # same settings: goes on
    code, msg = eyas("pipeline", _pipeline(tmp_path, tiny_llama_dir, train__ttt_steps=3))
    assert code == 2 and "train.ttt_steps: 2 there, 3 now" in msg


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
