"""fp8 stores against bf16: reconstruction error on a real target, and bytes and speed.

    python benchmarks/fp8_store.py error --samples 24 --json OUT.json      # CPU is fine
    python benchmarks/fp8_store.py speed --tokens 1500000 --store-dir /dev/shm --json OUT.json

error  SmolLM2-135M-Instruct (the built-in target) over the first ShareGPT conversations rendered
       with its chat template (cut at 512 tokens), aux [2, 15, 27] + final, computed in fp32. For
       bf16 and each fp8 scale layout (eyas.features.format.quantize, the code the store uses):
       relative error per token and state ||x' - x|| / ||x|| (mean, p99, max), the minimum cosine,
       and for the final state the teacher the trainer derives from it: KL(p || p') of the target's
       next-token distribution softmax(lm_head(norm(final))) and how often its argmax changes.
speed  `eyas extract` (HF backend) into --store-dir, bf16 then fp8, on a random-weight target of
       SmolLM2-135M's shape (30 layers, H=576; speed does not depend on the weights) and random
       tokens (lengths like ShareGPT's: 64..2048), each dtype twice in one process, the second run
       reported; then the offline feature loader (eyas.train.features.OfflineFeatures: read, copy,
       decode) over the same store, tokens/s. Bytes per token from the stores written.
tau    issue 21's check with eyas's own commands: `eyas extract --dtype bf16` and `--dtype fp8` of
       --data (a prepared dataset) into --store-dir, `eyas train --store` from each with --train (the
       same seed, data order and steps), then both drafts by `eyas evaluate --engine replay`
       (--evaluate; one set of target answers), fp8 against bf16, paired over the same turns.

    python benchmarks/fp8_store.py tau --data PREPARED --store-dir /dev/shm --json OUT.json \
        --train "--ttt-steps 7 --device cuda ..." --evaluate "--device cuda -k 5 --max-new-tokens 256"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _meta(args) -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = None
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": dev,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }


# ------------------------------------------------------------------------------ error


def error(args) -> dict:
    from eyas.data.formats import normalize, open_source
    from eyas.features.capture import HiddenStateCapture
    from eyas.features.format import dequantize, quantize
    from eyas.target import resolve_target

    torch.manual_seed(0)
    tgt = resolve_target("smollm2-135m-instruct")
    tok = tgt.load_tokenizer()
    _, recs = open_source("sharegpt")
    convs = []
    for r in recs:
        m = normalize(r)
        if isinstance(m, list) and m:
            convs.append(m)
        if len(convs) >= args.samples:
            break
    model = tgt.load_model(dtype=torch.float32)
    n = model.config.num_hidden_layers
    cap = HiddenStateCapture(model, [2, n // 2, n - 3])
    states = []
    with torch.inference_mode():
        for c in convs:
            ids = tok.apply_chat_template(c, tokenize=True, return_dict=False)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
            states.append(cap.capture_into(torch.tensor(ids[: args.max_len])[None])[0])
    x = torch.cat(states)  # [T, 4, H] fp32
    h = x.shape[-1]
    schemes = {"bf16": lambda v: v.to(torch.bfloat16).float()}
    for group in (h, 192, 64, 32):
        g = h // group
        schemes[f"fp8 e4m3, {g} scale(s) per token and state" + (" (default)" if g == 1 else "")] = lambda v, g=g: (
            dequantize(*quantize(v, g))
        )
    norm, head = model.model.norm, model.lm_head
    with torch.inference_mode():
        ref = torch.log_softmax(head(norm(x[:, -1])), -1)
        rows = {}
        for name, fn in schemes.items():
            y = fn(x)
            rel = (y - x).norm(dim=-1) / x.norm(dim=-1)
            cos = torch.nn.functional.cosine_similarity(y, x, dim=-1)
            lp = torch.log_softmax(head(norm(y[:, -1])), -1)
            kl = (ref.exp() * (ref - lp)).sum(-1)
            rows[name] = {
                "rel_err_mean": float(rel.mean()),
                "rel_err_p99": float(rel.quantile(0.99)),
                "rel_err_max": float(rel.max()),
                "min_cosine": float(cos.min()),
                "rel_err_mean_per_slot": [float(v) for v in rel.mean(0)],
                "teacher_kl_mean": float(kl.mean()),
                "teacher_kl_p99": float(kl.quantile(0.99)),
                "teacher_argmax_changed": float((lp.argmax(-1) != ref.argmax(-1)).float().mean()),
            }
    ratio = x.abs().amax(-1) / x.abs().median(-1).values
    return {
        "tokens": int(x.shape[0]),
        "samples": len(convs),
        "hidden": h,
        "aux_layers": cap.aux_layers,
        "amax_over_median_per_state": {
            "median": float(ratio.median()),
            "p99": float(ratio.quantile(0.99)),
            "max": float(ratio.max()),
        },
        "schemes": rows,
    }


# ------------------------------------------------------------------------------ speed


def _target(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny
    import transformers as tf

    tok = tiny.make_tokenizer(out)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=3,
    )
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _data(out: Path, target, tokens: int) -> Path:
    from eyas.data.dataset import write_prepared

    rng = np.random.default_rng(0)
    vocab = target.config()["vocab_size"]
    lens, total = [], 0
    while total < tokens:
        n = int(rng.integers(64, 2049))
        lens.append(n)
        total += n
    ids = [rng.integers(4, vocab, n).tolist() for n in lens]
    masks = [[1] * n for n in lens]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:64] = True
    return write_prepared(
        out,
        ids,
        masks,
        [f"rand:{i}" for i in range(len(lens))],
        target,
        torch.nonzero(t2d).flatten() - torch.arange(64),
        t2d,
    )


def speed(args) -> dict:
    from eyas.data.dataset import open_prepared
    from eyas.extract.config import ExtractConfig
    from eyas.extract.run import extract
    from eyas.features.verify import verify_store
    from eyas.target import resolve_target
    from eyas.train.features import OfflineFeatures
    from eyas.train.packing import pack_indices

    work = Path(args.store_dir) / "eyas-fp8-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tgt = resolve_target(_target(work / "target"))
    data = _data(work / "data", tgt, args.tokens)
    ds = open_prepared(data, tgt)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {
        "target": "random Llama of SmolLM2-135M's shape (30 layers, H=576), bf16 compute on CUDA",
        "samples": len(ds),
        "tokens": int(ds.lengths.sum()),
        "device": device,
        "runs": {},
    }
    for dtype in ("bf16", "fp8"):
        for rep in range(2):
            st = work / f"store-{dtype}"
            shutil.rmtree(st, ignore_errors=True)
            s = extract(
                ExtractConfig(
                    target=str(tgt.path),
                    data=data,
                    out=st,
                    layers=[2, 15, 27],
                    dtype=dtype,
                    device=device,
                    progress=False,
                )
            )
            out["runs"][f"{dtype} run {rep + 1}"] = {
                k: s[k] for k in ("tokens", "bytes", "bytes_per_token", "seconds", "tokens_per_s")
            }
        assert verify_store(st) == []
        feats_dtype = torch.bfloat16 if device == "cuda" else torch.float32
        f = OfflineFeatures(st, tgt, ds, None, torch.device(device), feats_dtype, 2048)
        packs = pack_indices(np.arange(len(ds)), ds.lengths, 2048, seed=0)
        batches = [packs[i : i + 16] for i in range(0, len(packs), 16)]
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        n_tok = 0
        f.prefetch(batches[0])
        for k, b in enumerate(batches):
            if k + 1 < len(batches):
                f.prefetch(batches[k + 1])
            batch = f.batch(b)
            n_tok += batch.num_tokens
        if device == "cuda":
            torch.cuda.synchronize()
        out["runs"][f"{dtype} offline loader"] = {
            "tokens": n_tok,
            "seconds": time.perf_counter() - t,
            "tokens_per_s": n_tok / (time.perf_counter() - t),
        }
        shutil.rmtree(st)
    shutil.rmtree(work, ignore_errors=True)
    return out


def tau(args) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))
    from paired import evaluate_and_pair

    work = Path(args.store_dir) / "eyas-fp8-tau"
    shutil.rmtree(work, ignore_errors=True)
    eyas = [sys.executable, "-m", "eyas.cli"]
    target = ["--target", args.target, "--data", args.data]
    seconds: dict[str, float] = {}
    for dtype in ("bf16", "fp8"):
        for stage, cmd in (
            (
                "extract",
                [
                    *eyas,
                    "extract",
                    *target,
                    "--out",
                    str(work / f"store-{dtype}"),
                    "--dtype",
                    dtype,
                    *args.extract.split(),
                    "--quiet",
                ],
            ),
            (
                "train",
                [
                    *eyas,
                    "train",
                    *target,
                    "--features",
                    "offline",
                    "--store",
                    str(work / f"store-{dtype}"),
                    "--out",
                    str(work / f"run-{dtype}"),
                    *args.train.split(),
                    "--quiet",
                ],
            ),
        ):
            t = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
            seconds[f"{stage} {dtype}"] = round(time.perf_counter() - t, 1)
        shutil.rmtree(work / f"store-{dtype}")  # the stores are the large part; the runs stay
    runs = {d: json.loads((work / f"run-{d}" / "summary.json").read_text()) for d in ("bf16", "fp8")}
    paired = evaluate_and_pair(
        {d: work / f"run-{d}" / "draft" for d in ("bf16", "fp8")},
        work,
        ["--target", args.target, *args.evaluate.split()],
    )
    return {
        "data": args.data,
        "train": args.train,
        "extract": args.extract,
        "seconds": seconds,
        "steps": {d: r["steps"] for d, r in runs.items()},
        "heldout_acc": {d: (r.get("heldout") or {}).get("acc") for d, r in runs.items()},
        "tau": paired,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["error", "speed", "tau"])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="tau: the target")
    ap.add_argument("--data", help="tau: a prepared dataset (`eyas prepare`)")
    ap.add_argument("--extract", default="--layers 2,15,27", help="tau: more `eyas extract` settings")
    ap.add_argument("--train", default="--ttt-steps 3 --max-steps 60 --device cpu", help="tau: `eyas train` settings")
    ap.add_argument(
        "--evaluate",
        default="--max-per-category 2 --max-new-tokens 64 -k 3",
        help="tau: `eyas evaluate` settings (replay)",
    )
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1_500_000)
    ap.add_argument("--store-dir", default="/dev/shm")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {**_meta(args), **{"error": error, "speed": speed, "tau": tau}[args.what](args)}
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
