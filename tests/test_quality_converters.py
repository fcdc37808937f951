"""Converters of the speculators comparison (benchmarks/quality): eyas store -> speculators data,
speculators checkpoint -> a draft eyas's evaluation loop runs.

The checks against speculators' own code run it in .venvs/speculators (speculators==0.9.0 over
.venv's CPU torch; `make spec-env`, part of `make test`); they are skipped where that venv does not
exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
SPEC_PY = ROOT / ".venvs" / "speculators" / "bin" / "python"
needs_spec = pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venvs/speculators (speculators==0.9.0)")

AUX = [1, 3, 4]


def _spec_run(code: str, tmp: Path, *args: str) -> str:
    script = tmp / "spec_ref.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([str(SPEC_PY), str(script), *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_llama_dir):
    """A prepared dataset (random token streams, ragged masks) and its HF-extracted store."""
    from eyas.data.dataset import write_prepared
    from eyas.data.vocab import build_draft_vocab, count_trained_tokens
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract
    from eyas.target import resolve_target

    tmp = tmp_path_factory.mktemp("quality")
    tgt = resolve_target(tiny_llama_dir)
    rng = np.random.default_rng(0)
    ids, masks = [], []
    for _ in range(12):
        n = int(rng.integers(12, 40))
        ids.append(rng.integers(5, 300, n).tolist())
        m = np.zeros(n, dtype=int)
        m[int(rng.integers(1, n // 2)) :] = 1
        masks.append(m.tolist())
    vocab = int(json.loads((Path(tiny_llama_dir) / "config.json").read_text())["vocab_size"])
    counts = count_trained_tokens([np.array(x) for x in ids], [np.array(m, bool) for m in masks], vocab)
    d2t, t2d, _ = build_draft_vocab(counts, 64)
    prep = write_prepared(tmp / "prep", ids, masks, [f"s{i}" for i in range(len(ids))], tgt, d2t, t2d)
    extract(
        ExtractConfig(
            target=str(tiny_llama_dir),
            data=prep,
            out=tmp / "store",
            layers=AUX,
            device="cpu",
            dtype="fp32",
            progress=False,
        )
    )
    return tmp, prep, tmp / "store"


def test_store_to_speculators_layout_and_values(tiny_store):
    import datasets
    from safetensors.torch import load_file

    import to_speculators
    from eyas.data.dataset import open_prepared
    from eyas.features.reader import open_store

    tmp, prep, store = tiny_store
    out = tmp / "spec_data"
    summary = to_speculators.convert(store, None, out, threads=2, progress=False)
    reader = open_store(store)
    assert summary["samples"] == len(reader) == 12
    assert summary["aux_layers"] == AUX and summary["draft_vocab_size"] == 64
    table = datasets.load_from_disk(str(out))
    assert len(table) == 12 and table.format["type"] == "torch"
    for row, idx in enumerate(sorted(int(i) for i in reader.indices)):
        s = reader[idx]
        f = load_file(str(out / "hidden_states" / f"hs_{row}.safetensors"))
        assert f["hidden_states"].shape == (s.input_ids.shape[0], len(AUX) + 1, 64)
        torch.testing.assert_close(f["hidden_states"][:, :-1], s.aux, rtol=0, atol=0)
        torch.testing.assert_close(f["hidden_states"][:, -1], s.final, rtol=0, atol=0)
        assert torch.equal(f["token_ids"], s.input_ids.long())
        assert torch.equal(table[row]["input_ids"], s.input_ids.long())
        assert torch.equal(table[row]["loss_mask"].bool(), s.loss_mask.bool())
        assert int(table[row]["seq_len"]) == s.input_ids.shape[0]
    d2t, t2d = open_prepared(prep).draft_vocab()
    assert np.array_equal(np.load(out / "d2t-64.npy"), d2t.numpy())
    assert np.array_equal(np.load(out / "t2d-64.npy"), t2d.numpy())
    with pytest.raises(Exception, match="not empty"):
        to_speculators.convert(store, None, out, progress=False)


def test_consuming_the_store_writes_the_same_data_and_deletes_it(tiny_store, tiny_llama_dir):
    """--consume (a speculators-only session: one copy of the states on disk) gives the same files
    as a plain conversion, deleting the store shard by shard, and leaves no store that looks whole."""
    import shutil

    from safetensors.torch import load_file

    import to_speculators
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract

    tmp, prep, _ = tiny_store
    store = tmp / "store_small_shards"  # a shard per few samples
    cfg = dict(target=str(tiny_llama_dir), data=prep, layers=AUX, device="cpu", dtype="fp32", progress=False)
    extract(ExtractConfig(out=store, batch_tokens=96, **cfg))
    assert len(list(store.glob("shard-*.safetensors"))) > 2
    copy = tmp / "store_consumed"
    shutil.copytree(store, copy)
    plain = to_speculators.convert(store, prep, tmp / "plain", threads=2, progress=False)
    used = to_speculators.convert(copy, prep, tmp / "used", threads=2, progress=False, consume=True)
    assert not copy.exists() and store.exists()
    assert used["store_consumed"] and not plain["store_consumed"]
    assert (used["samples"], used["tokens"]) == (plain["samples"], plain["tokens"]) and used["samples"] == 12
    for row in range(12):
        a = load_file(str(tmp / "plain" / "hidden_states" / f"hs_{row}.safetensors"))
        b = load_file(str(tmp / "used" / "hidden_states" / f"hs_{row}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("d2t-64.npy", "t2d-64.npy", "data-00000-of-00001.arrow"):
        assert (tmp / "plain" / name).read_bytes() == (tmp / "used" / name).read_bytes()
    with pytest.raises(Exception, match="takes no --limit"):
        to_speculators.convert(store, prep, tmp / "limited", limit=3, progress=False, consume=True)


SPEC_READ = r"""
import sys, torch
from speculators.train.data import ArrowDataset
from speculators.models.eagle3.data import shift_batch
ds = ArrowDataset(max_len=4096, datapath=sys.argv[1], on_missing="raise", train_ratio=1.0)
ok = 0
for i in range(len(ds)):
    s = ds[i]
    assert s["hidden_states"].shape[1] == 3 * 64, s["hidden_states"].shape
    b = shift_batch(s)
    assert b["hidden_states"].shape[0] == b["input_ids"].shape[0] == s["input_ids"].shape[0] - 1
    ok += 1
print("OK", ok, float(s["verifier_last_hidden_states"].float().abs().sum()))
"""


@needs_spec
def test_speculators_reads_converted_data(tiny_store):
    """speculators' own dataset class loads every converted sample (no fallbacks, no warnings)."""
    tmp, _, store = tiny_store
    out = tmp / "spec_data_read"
    import to_speculators

    to_speculators.convert(store, None, out, threads=2, progress=False)
    res = _spec_run(SPEC_READ, tmp, str(out)).split()
    assert res[0] == "OK" and int(res[1]) == 12
    from eyas.features.reader import open_store

    reader = open_store(store)
    last = reader[int(sorted(reader.indices)[-1])].final.float().abs().sum()
    assert abs(float(res[2]) - float(last)) < 1e-3 * float(last)


SPEC_REF = r"""
import sys, json, torch
import numpy as np
from pathlib import Path
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

target, out, inputs, flags = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
torch.manual_seed(0)
tl = create_transformer_layer_config(target, 1, "llama", None, 2048, [])
tl._attn_implementation = "eager"
d2t = torch.from_numpy(np.load(Path(inputs).parent / "d2t.npy"))
t2d = torch.from_numpy(np.load(Path(inputs).parent / "t2d.npy"))
cfg = Eagle3SpeculatorConfig(
    transformer_layer_config=tl, draft_vocab_size=int(d2t.numel()),
    norm_before_residual=flags["nbr"], norm_before_fc=flags["nbf"], fc_norm=flags.get("fcn", False),
    norm_output=flags["nout"], embed_requires_grad=False, eagle_aux_hidden_state_layer_ids=[1, 3, 4],
    speculators_config=SpeculatorsConfig(algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(target)))
model = Eagle3DraftModel(cfg)
model.load_vocab_mappings(t2d, d2t)
model.load_verifier_weights()
with torch.no_grad():  # trained-looking weights: nothing left at its init value
    for n, p in model.named_parameters():
        if not n.startswith(("embed_tokens", "verifier_")):
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
model.eval()
model.save_pretrained(out)
x = load_file(inputs)
logits = []
h = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))
with torch.no_grad():
    model(hidden_states=x["aux"][None], input_ids=x["ids"][None],
          document_ids=torch.zeros(1, x["ids"].numel(), dtype=torch.long),
          position_ids=1 + torch.arange(x["ids"].numel())[None], ttt_steps=3)
save_file({f"step{j}": l[0].contiguous() for j, l in enumerate(logits)}, str(out / "ref_logits.safetensors"))
print("OK")
"""


@needs_spec
@pytest.mark.parametrize(
    "flags",
    [
        {"nbr": True, "nbf": True, "nout": True},  # speculators 0.9.0's EAGLE-3 defaults
        {"nbr": False, "nbf": False, "nout": False},  # the classic head
        {"nbr": True, "nbf": False, "nout": False, "fcn": True},  # a norm per aux layer
    ],
)
def test_speculators_checkpoint_runs_in_eyas_step_loop(tiny_store, tiny_llama_dir, flags):
    """Logits of every TTT step of speculators' own forward = the converted draft driven through
    eyas's inference API (step + DraftKVCache), position by position."""
    from safetensors.torch import load_file, save_file

    import from_speculators
    from eyas.draft.model import DraftKVCache, Eagle3Draft

    tmp, prep, store = tiny_store
    case = tmp / ("ref_" + "".join("1" if flags.get(k) else "0" for k in ("nbr", "nbf", "nout", "fcn")))
    case.mkdir()
    from eyas.data.dataset import open_prepared
    from eyas.features.reader import open_store

    d2t, t2d = open_prepared(prep).draft_vocab()
    np.save(case / "d2t.npy", d2t.numpy())
    np.save(case / "t2d.npy", t2d.numpy())
    s = open_store(store)[0]
    t = s.input_ids.shape[0] - 1
    aux = s.aux[:-1].reshape(t, -1).float().contiguous()
    ids = s.input_ids[1:].long().contiguous()
    save_file({"aux": aux, "ids": ids}, str(case / "inputs.safetensors"))
    _spec_run(
        SPEC_REF,
        case,
        str(tiny_llama_dir),
        str(case / "spec_ckpt"),
        str(case / "inputs.safetensors"),
        json.dumps(flags),
    )
    ref = load_file(str(case / "spec_ckpt" / "ref_logits.safetensors"))

    from_speculators.convert(case / "spec_ckpt", tiny_llama_dir, case / "eyas_draft")
    draft = Eagle3Draft.from_pretrained(case / "eyas_draft")  # eyas's own head and loader
    cfg = draft.config
    assert (cfg.norm_before_residual, cfg.norm_before_fc, cfg.norm_output, cfg.fc_norm) == (
        flags["nbr"],
        flags["nbf"],
        flags["nout"],
        flags.get("fcn", False),
    )
    draft.eval()
    with torch.no_grad():
        cache = DraftKVCache()
        l0, h0 = draft.step(aux[None], ids[None], torch.arange(t)[None], cache, from_target=True)
        torch.testing.assert_close(l0[0], ref["step0"], rtol=1e-4, atol=1e-4)
        checked = 0
        for i in range(t - 2):
            c = cache.clone()
            c.crop(i + 1)
            h = h0[:, i : i + 1]
            for j in (1, 2):
                lj, h = draft.step(h, ids[None, i + j : i + j + 1], torch.tensor([[i + j]]), c, from_target=False)
                torch.testing.assert_close(lj[0, 0], ref[f"step{j}"][i], rtol=1e-4, atol=1e-4)
                checked += 1
        # eyas's own training unroll (what `eyas train` optimises) agrees with speculators' too
        unroll = draft(
            s.aux.reshape(t + 1, -1).float()[None],
            s.input_ids.long()[None],
            torch.arange(t + 1)[None],
            torch.zeros(1, t + 1, dtype=torch.long),
            3,
            attention="dense",
        )
        for j in range(3):
            torch.testing.assert_close(unroll[j][0, : t - 2], ref[f"step{j}"][: t - 2], rtol=1e-4, atol=1e-4)
    assert checked == 2 * (t - 2)


def _spec_data(tmp: Path, store: Path) -> Path:
    """The tiny store in speculators' layout, converted once for every spec_train.py test (which
    only read it)."""
    import to_speculators

    data = tmp / "spec_data_train"
    if not data.exists():
        to_speculators.convert(store, None, data, threads=2, progress=False)
    return data


@needs_spec
def test_spec_train_stopped_and_resumed_ends_as_one_run(tiny_store, tiny_llama_dir):
    """benchmarks/quality/spec_train.py: a session stopped after its first step (--stop-after-s 0)
    and continued (--resume) runs the rest of the plan in speculators' own trainer and ends, with
    fp32 checkpoints, with the very weights of one uninterrupted run."""
    from safetensors.torch import load_file

    tmp, _, store = tiny_store
    data = _spec_data(tmp, store)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")

    def spec_train(out: Path, *args: str) -> dict:
        cmd = [str(SPEC_PY), str(ROOT / "benchmarks" / "quality" / "spec_train.py"), "--cpu"]
        cmd += ["--verifier", str(tiny_llama_dir), "--data", str(data), "--num-workers", "0", "--out", str(out)]
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads((out / "spec_train.json").read_text())

    plan = ["--budget-s", "600", "--probe-steps", "0", "--epochs", "2", "--fp32-checkpoints"]
    packs = ["--", "--total-seq-len", "64"]  # a few steps an epoch from 12 short samples
    one = spec_train(tmp / "st_one", *plan, *packs)
    first = spec_train(tmp / "st_two", *plan, "--stop-after-s", "0", *packs)
    assert one["stopped"] is None and one["run"]["steps"] >= 4
    assert first["stopped"]["global_step"] == 1 and first["run"]["steps"] == 1
    rest = spec_train(tmp / "st_two", "--resume")
    assert rest["stopped"] is None and rest["resumed_from"]["global_step"] == 1
    assert rest["run"]["steps"] == one["run"]["steps"] - 1 and rest["plan"] == first["plan"]
    a = load_file(str(Path(one["checkpoint"]) / "model.safetensors"))
    b = load_file(str(Path(rest["checkpoint"]) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs_spec
def test_spec_train_planned_from_an_earlier_record_runs_no_probe(tiny_store, tiny_llama_dir):
    """spec_train.py --probe-from: the plan for this budget from an earlier run's measured steps,
    validations and saves, with no probe run; a file that holds no such record is named."""
    from spec_train import plan

    tmp, _, store = tiny_store
    data = _spec_data(tmp, store)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [str(SPEC_PY), str(ROOT / "benchmarks" / "quality" / "spec_train.py"), "--cpu"]
    cmd += ["--verifier", str(tiny_llama_dir), "--data", str(data), "--num-workers", "0"]
    packs = ["--", "--total-seq-len", "64"]
    r = subprocess.run(
        [*cmd, "--out", str(tmp / "pf_one"), "--budget-s", "600", "--probe-steps", "0", "--epochs", "2", *packs],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    earlier = tmp / "pf_one" / "spec_train.json"
    one = json.loads(earlier.read_text())
    r = subprocess.run(
        [*cmd, "--out", str(tmp / "pf_two"), "--budget-s", "4", "--probe-from", str(earlier), *packs],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads((tmp / "pf_two" / "spec_train.json").read_text())
    assert not (tmp / "pf_two" / "probe").exists() and "probe" not in two
    assert two["plan"] == plan(4.0, one["run"])
    # the same data: its packing may make an epoch a batch longer or shorter from run to run
    got = two["probe_from"]
    assert {k: got[k] for k in ("file", "record", "steps_per_epoch")} == {
        "file": str(earlier), "record": "run", "steps_per_epoch": one["run"]["steps_per_epoch"],
    }  # fmt: skip
    assert got["steps_per_epoch_now"] == two["run"]["steps_per_epoch"] > 0
    assert two["run"]["steps"] >= 1 and two["checkpoint"]
    # a file with no steps recorded: refused before any trainer starts, the file named
    bad = tmp / "pf_bad.json"
    bad.write_text(json.dumps({"budget_s": 4}))
    r = subprocess.run(
        [*cmd, "--out", str(tmp / "pf_bad"), "--budget-s", "4", "--probe-from", str(bad), *packs],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode != 0 and str(bad) in r.stderr and "recorded steps" in r.stderr
    assert not (tmp / "pf_bad" / "run").exists()


def _spec_train_cmd(tmp: Path, store: Path, tiny_llama_dir, name: str, workers: int) -> tuple[list[str], Path]:
    """spec_train.py's arguments for a run on the CPU that saves (and keeps) after every step until
    it is stopped, with ``workers`` data loader workers; and its --out."""
    out = tmp / f"st_{name}"
    data = _spec_data(tmp, store)
    cmd = [
        "--cpu", "--verifier", str(tiny_llama_dir), "--data", str(data), "--out", str(out),
        "--num-workers", str(workers), "--budget-s", "600", "--probe-steps", "0", "--epochs", "1000",
        "--save-every-s", "0", "--keep-saves", "--", "--total-seq-len", "64",
    ]  # fmt: skip
    return cmd, out


def _until_kept(out: Path, p: subprocess.Popen, log: Path, n: int = 3) -> None:
    """Wait until the run in ``out`` has kept ``n`` saves; it must still be running then."""
    import time

    deadline = time.time() + 300
    while len(list((out / "kept").glob("step-*"))) < n and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, log.read_text()[-3000:]


def _spec_train_with_save(tmp: Path, store: Path, tiny_llama_dir, name: str, save_body: str):
    """spec_train.py run on the CPU with speculators' ``Trainer.maybe_save_checkpoint`` replaced by
    ``save_body`` (a function body: ``orig`` is the original, ``calls`` the epochs so far); its
    run saves after every step until the body fails it. Returns (the finished process, its --out)."""
    args, out = _spec_train_cmd(tmp, store, tiny_llama_dir, name, workers=0)
    wrapper = tmp / f"{name}_spec_train.py"
    body = "".join(f"    {line}\n" for line in save_body.strip("\n").splitlines())
    wrapper.write_text(
        "import os, runpy, signal, sys, threading\n"
        "import speculators.train.trainer as tr\n"
        "orig, calls = tr.Trainer.maybe_save_checkpoint, []\n"
        "def save(self, epoch, local_step=0):\n"
        "    calls.append(epoch)\n"
        f"{body}"
        "tr.Trainer.maybe_save_checkpoint = save\n"
        f"sys.argv = [{str(ROOT / 'benchmarks' / 'quality' / 'spec_train.py')!r}] + sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    r = subprocess.run([str(SPEC_PY), str(wrapper), *args], capture_output=True, text=True, env=env, timeout=600)
    return r, out


@needs_spec
def test_spec_train_failing_mid_run_records_its_whole_saves(tiny_store, tiny_llama_dir):
    """benchmarks/quality/spec_train.py when speculators' trainer fails mid-run (in session 21 a
    SIGTERM to the process group killed its loader's worker and the trainer died in its interrupt
    save): the record is still written, says it failed, and names the saves made whole before, the
    last of them as the draft to evaluate, never the save the failure cut."""
    from safetensors.torch import load_file

    tmp, _, store = tiny_store
    # speculators' own save fails on its fourth call, as the loader's signal handler made it fail
    r, out = _spec_train_with_save(
        tmp, store, tiny_llama_dir, "failing",
        """
if len(calls) == 4:
    raise RuntimeError('DataLoader worker (pid 1) is killed by signal: Terminated.')
return orig(self, epoch, local_step=local_step)
""",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    rec = json.loads((out / "spec_train.json").read_text())
    assert "killed by signal" in rec["error"] and rec["run"]["error"] == rec["error"]
    at = rec["run"]["ckpt_at"]
    assert len(at) == 4 and "kept" not in at[-1]  # the failed save left no copy
    kept = [c["kept"] for c in at[:3]]
    assert rec["checkpoint"] == kept[-1]
    for k in kept:
        assert load_file(str(Path(k) / "model.safetensors"))


@needs_spec
def test_spec_train_whose_interrupt_save_fails_evaluates_its_last_whole_save(tiny_store, tiny_llama_dir):
    """A SIGTERM, then speculators' interrupt save fails part-way (CI saw it: the loader's SIGCHLD
    handler raised in it); speculators logs that and returns as if it had saved. The record says
    the run failed, the partial ``interrupted/`` is gone and the draft is the last kept save."""
    from safetensors.torch import load_file

    tmp, _, store = tiny_store
    # a SIGTERM as the fourth save begins (raised in the main thread, so speculators' handler runs
    # right there: a timer's signal landed where it was lost once in CI and the run went on to rc 0);
    # the interrupt save writes its first file, then fails
    r, out = _spec_train_with_save(
        tmp, store, tiny_llama_dir, "intfail",
        """
if epoch == 'interrupted':
    d = self.checkpointer.path / 'interrupted'
    d.mkdir(parents=True, exist_ok=True)
    (d / 'config.json').write_text('{}')  # save_pretrained's first file
    raise RuntimeError('DataLoader worker (pid 1) is killed by signal: Terminated.')
if len(calls) == 4:
    signal.raise_signal(signal.SIGTERM)
return orig(self, epoch, local_step=local_step)
""",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    rec = json.loads((out / "spec_train.json").read_text())
    assert rec["error"].startswith("the interrupt save failed") and "killed by signal" in rec["error"]
    assert rec["run"]["interrupted"] is False
    assert not (out / "run" / "interrupted").exists()
    kept = [c["kept"] for c in rec["run"]["ckpt_at"] if c.get("kept")]
    assert len(kept) >= 3 and rec["checkpoint"] == kept[-1]
    for k in kept:
        assert load_file(str(Path(k) / "model.safetensors"))


@needs_spec
def test_run_quality_stops_speculators_through_its_leader_so_its_interrupt_save_is_made(tiny_store, tiny_llama_dir):
    """run_quality's deadline for speculators' run (its Runner.wait, leader_first) signals
    spec_train.py alone, not its loader's worker: the trainer saves its interrupt checkpoint whole
    and the record names it, without an error."""
    import importlib.util
    import types

    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("run_quality", ROOT / "benchmarks" / "quality" / "run_quality.py")
    rq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rq)
    tmp, _, store = tiny_store
    args, out = _spec_train_cmd(tmp, store, tiny_llama_dir, "leader", workers=1)
    r = rq.Runner(types.SimpleNamespace(work=str(tmp / "rq_leader"), deadline_s=600.0))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    p = r.start("spec_main", [SPEC_PY, ROOT / "benchmarks" / "quality" / "spec_train.py", *args], env=env)
    try:
        _until_kept(out, p, r.logs / "spec_main.log")
        r.wait(p, timeout=0.1, check=False, leader_first=True)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
    assert p.returncode == 0, (r.logs / "spec_main.log").read_text()[-3000:]
    rec = json.loads((out / "spec_train.json").read_text())
    assert rec["run"]["interrupted"] is True and "error" not in rec
    assert rec["checkpoint"] == str(out / "run" / "interrupted")
    assert load_file(str(out / "run" / "interrupted" / "model.safetensors"))


@needs_spec
def test_spec_train_killed_with_its_process_group_keeps_its_saves(tiny_store, tiny_llama_dir):
    """spec_train.py given a real SIGTERM to its whole process group, its loader's worker included
    (run_quality's deadline did so until it signalled the leader alone; any stop from outside still
    can): whether the trainer then saves its interrupt checkpoint or fails (a race), the record is
    written and names a whole checkpoint to evaluate and every kept save."""
    import signal

    from safetensors.torch import load_file

    tmp, _, store = tiny_store
    args, out = _spec_train_cmd(tmp, store, tiny_llama_dir, "killed", workers=1)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [str(SPEC_PY), str(ROOT / "benchmarks" / "quality" / "spec_train.py"), *args]
    with (tmp / "st_killed.log").open("w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _until_kept(out, p, tmp / "st_killed.log")
            os.killpg(p.pid, signal.SIGTERM)
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert rc in (0, 1), (tmp / "st_killed.log").read_text()[-3000:]
    rec = json.loads((out / "spec_train.json").read_text())
    kept = [c["kept"] for c in rec["run"]["ckpt_at"] if c.get("kept")]
    assert len(kept) >= 3
    assert rec["checkpoint"] in (str(out / "run" / "interrupted"), kept[-1])
    for k in [*kept, rec["checkpoint"]]:
        assert load_file(str(Path(k) / "model.safetensors"))
