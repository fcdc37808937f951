"""GPU correctness check (not a speed measurement) of `eyas train --parallel/--attention` on 2 GPUs.

    python3 scripts/check_parallel_gpu.py        # from the repo root, on a machine with 2 CUDA GPUs

Trains a tiny random Llama target's draft (online features, fp32, 6 steps, global batch 2 packs)
as: 1 process dense, 1 process flex, DDP flex, FSDP2 flex (NCCL), FSDP2 bf16; then resumes the
FSDP2 run from its step-3 checkpoint. Prints per-step losses, grad norms and the largest
differences against the single-process dense run. Work files go to /tmp/gc.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOG = open(os.path.join(os.environ.get("OUT", "/tmp"), "runs.log"), "w")
sys.path.insert(0, "tests")
sys.path.insert(0, "src")
os.environ["EYAS_CACHE"] = "/tmp/gc/cache"
# after sys.path and EYAS_CACHE are set above
import tiny  # noqa: E402
from eyas.target import resolve_target  # noqa: E402
from test_train_run import _write_data  # noqa: E402
from eyas.settings import to_json  # noqa: E402
from eyas.train.trainer import TrainConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

w = Path("/tmp/gc")
shutil.rmtree(w, ignore_errors=True)
w.mkdir()
t = resolve_target(tiny.make_target(w / "t", "llama"))
data = _write_data(w / "data", t, n=200)


def spec(name, **kw):
    base = dict(
        target=str(t.path),
        data=str(data),
        out=str(w / name),
        features="online",
        layers=[1, 4, 6],
        ttt_steps=3,
        tokens_per_batch=256,
        max_steps=6,
        warmup=2,
        lr=2e-3,
        save_every=3,
        eval_every=0,
        eval_batches=3,
        heldout=0.15,
        progress=False,
        device="cuda",
        precision="fp32",
    )
    base.update(kw)
    p = w / f"{name}.json"
    p.write_text(to_json(TrainConfig(**base)))
    return p


env = {**os.environ, "PYTHONPATH": "src", "OMP_NUM_THREADS": "1", "TORCH_LOGS": "recompiles"}


def go(name, n, p):
    t0 = time.time()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "eyas.train.launch",
            str(p),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode:
        print(name, "FAILED", r.stderr[-1500:], flush=True)
        LOG.write(name + "\n" + r.stderr + "\n")
        LOG.flush()
        return None
    LOG.write(f"== {name}\n" + r.stderr + "\n")
    LOG.flush()
    recompiles = r.stderr.count("Recompiling function")
    recs = [json.loads(ln) for ln in (w / name / "metrics.jsonl").read_text().splitlines()]
    tr = [r["loss"] for r in recs if r["split"] == "train"]
    s = json.loads((w / name / "summary.json").read_text())
    print(
        f"{name}: {time.time() - t0:.0f}s losses {[round(x, 6) for x in tr]} grad_norms "
        f"{[round(r['grad_norm'], 5) for r in recs if r['split'] == 'train']} heldout {s['heldout']['loss']} "
        f"parallel {s['parallel']} attention {s['attention']} dynamo recompiles (all ranks) {recompiles}",
        flush=True,
    )
    return tr


res = {}
res["single-dense"] = go("single-dense", 1, spec("single-dense", grad_accum=2, attention="dense"))
res["single-flex"] = go("single-flex", 1, spec("single-flex", grad_accum=2, attention="flex"))
res["ddp-flex"] = go("ddp-flex", 2, spec("ddp-flex", attention="flex", parallel="ddp"))
res["fsdp2-flex"] = go("fsdp2-flex", 2, spec("fsdp2-flex", attention="flex", parallel="fsdp2"))
res["fsdp2-bf16"] = go("fsdp2-bf16", 2, spec("fsdp2-bf16", attention="auto", parallel="fsdp2", precision="bf16"))
# resume fsdp2 from step 3
r = w / "fsdp2-flex"
if res["fsdp2-flex"]:
    a = load_file(str(r / "draft" / "model.safetensors"))
    shutil.rmtree(r / "draft")
    shutil.rmtree(r / "checkpoints" / "step-00000006")
    p = spec("fsdp2-flex", attention="flex", parallel="fsdp2", resume=True)
    tr = go("fsdp2-flex", 2, p)
    b = load_file(str(r / "draft" / "model.safetensors"))
    print(
        "fsdp2 resume: max weight diff",
        max(float((a[k].float() - b[k].float()).abs().max()) for k in a),
        "losses equal",
        tr == res["fsdp2-flex"],
    )
base = res["single-dense"]
for k, v in res.items():
    if v and base:
        print(f"{k} vs single-dense: max rel loss diff {max(abs(x - y) / abs(y) for x, y in zip(v, base)):.2e}")
for k in ["single-flex", "ddp-flex", "fsdp2-flex"]:
    if not (res.get(k) and res.get("single-dense")):
        continue
    a = load_file(str(w / "single-dense" / "draft" / "model.safetensors"))
    b = load_file(str(w / k / "draft" / "model.safetensors"))
    print(k, "max weight diff vs single-dense", max(float((a[n].float() - b[n].float()).abs().max()) for n in a))
