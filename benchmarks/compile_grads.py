"""Gradients of one TTT batch, compiled against eager, to find what `eyas train --compile` computes
differently (issue 16). CUDA only: flex attention has no backward on the CPU.

Every variant runs in a process of its own (a fresh compile state) on the same random batch
(random aux states, a random packed-document layout, random target logits) and the same weights,
and writes its loss, per-step logits and parameter gradients to WORK/VARIANT-STATE.pt. ``--compare``
then prints each variant's relative gradient error against the fp32 dense eager reference:
``||g - g_ref|| / ||g_ref||`` per parameter.

  python benchmarks/compile_grads.py --work /dev/shm/cg --variant ref --state init
  ...
  python benchmarks/compile_grads.py --work /dev/shm/cg --compare --json out.json

Variants: ref (dense attention, eager, fp32), flex (eager model, flex compiled on its own, the
path of uncompiled training on CUDA), model (torch.compile of the whole TTT forward, `--compile`'s
default scope), regions (`--compile-scope regions`), model-masks-out (whole forward compiled, the
block masks built outside the graph), model-flex-out (whole forward compiled, flex attention
outside the graph). States: init (the draft as `eyas train` starts it) and peaky (q/k weights x6:
sharp attention, as a trained draft has).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

VARIANTS = ("ref", "flex", "model", "regions", "model-masks-out", "model-flex-out")


def build(state: str, ttt: int, device: torch.device):
    from eyas.draft.model import DraftConfig, Eagle3Draft

    g = torch.Generator().manual_seed(0)
    h, b, t = 576, 4, 2048
    cfg = DraftConfig(
        hidden_size=h,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=32000,
        aux_layer_ids=[2, 15, 27],
        target_hidden_size=h,
        norm_before_residual=True,
    )
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    if state == "peaky":
        with torch.no_grad():
            model.midlayer.self_attn.q_proj.weight.mul_(6)
            model.midlayer.self_attn.k_proj.weight.mul_(6)
    aux = torch.randn(b, t, 3 * h, generator=g) * torch.tensor([3.0, 6.0, 23.0]).repeat_interleave(h)
    ids = torch.randint(0, 49152, (b, t), generator=g)
    doc = torch.full((b, t), -1, dtype=torch.long)
    pos = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        at, d = 0, 0
        while at < t - 200:
            n = int(torch.randint(20, 900, (1,), generator=g))
            n = min(n, t - 100 - at)
            doc[r, at : at + n] = d
            pos[r, at : at + n] = torch.arange(n)
            at, d = at + n, d + 1
        pos[r, at:] = torch.arange(t - at)
    loss_mask = torch.rand(b, t, generator=g) < 0.5
    tgt = torch.randn(b, t, 32000, generator=g) * 3
    return model.to(device), [x.to(device) for x in (aux, ids, pos, doc, loss_mask, tgt)]


def run(variant: str, state: str, ttt: int, work: Path) -> None:
    from eyas.draft import flex
    from eyas.draft.loss import ttt_loss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, (aux, ids, pos, doc, loss_mask, tgt) = build(state, ttt, device)
    attention = "dense" if variant == "ref" else "flex"
    fwd = model
    if variant == "regions":
        model.compile_regions()
    elif variant.startswith("model"):
        if variant == "model-masks-out":
            flex.ttt_block_masks = torch.compiler.disable(flex.ttt_block_masks)
        if variant == "model-flex-out":
            flex.ttt_attention = torch.compiler.disable(flex.ttt_attention)
        fwd = torch.compile(model)
    out = fwd(aux, ids, pos, doc, ttt, attention=attention)
    loss, stats = ttt_loss(out, tgt, loss_mask, doc, 0.8)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    torch.save(
        {
            "loss": loss.item(),
            "step_loss": [(s.loss_sum / s.count).item() for s in stats],
            "logits": [o.detach().float()[:, :, :256].cpu() for o in out],
            "grads": grads,
        },
        work / f"{variant}-{state}-ttt{ttt}.pt",
    )
    print(f"{variant} {state} ttt{ttt}: loss {loss.item():.6f}", flush=True)


def compare(work: Path, out_json: Path | None) -> None:
    rows = []
    for ref_path in sorted(work.glob("ref-*.pt")):
        key = ref_path.stem[len("ref-") :]
        ref = torch.load(ref_path)
        for v in VARIANTS[1:]:
            p = work / f"{v}-{key}.pt"
            if not p.exists():
                continue
            x = torch.load(p)
            errs = {n: ((x["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in ref["grads"].items()}
            logit_err = [((a - r).norm() / r.norm()).item() for a, r in zip(x["logits"], ref["logits"])]
            nonfinite = [n for n, g in x["grads"].items() if not torch.isfinite(g).all()]
            rows.append(
                {
                    "variant": v,
                    "case": key,
                    "loss": x["loss"],
                    "ref_loss": ref["loss"],
                    "logit_rel_err_per_step": logit_err,
                    "grad_rel_err": errs,
                    "nonfinite_grads": nonfinite,
                }
            )
            worst = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
            print(
                f"{key:18s} {v:16s} loss {x['loss']:.5f} (ref {ref['loss']:.5f}) logits err "
                f"{max(logit_err):.2e}  worst grads "
                + ", ".join(f"{n} {e:.2e}" for n, e in worst)
                + (f"  NONFINITE {nonfinite}" if nonfinite else "")
            )
    if out_json:
        out_json.write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--state", choices=("init", "peaky"), default="init")
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.compare:
        compare(a.work, a.json)
    elif a.variant:
        run(a.variant, a.state, a.ttt, a.work)
    else:
        sys.exit("pass --variant or --compare")


if __name__ == "__main__":
    main()
