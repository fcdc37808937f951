"""torchrun worker of test_draft_model.py's sharded fused-loss test (gloo, CPU, float64).

Each rank trains on its own micro-batch (different lengths; one too short for the last TTT step)
through FSDP2 with lm_head its own never-forwarded unit (parallel.wrap(..., fused_loss=True)), so
the fused loss gets the sharded DTensor. Every rank also computes, in-process and unsharded, every
rank's single-process fused loss: the sharded value and stats must equal its own rank's, and every
gradient (each rank's shard, gathered) the mean over ranks of the single-process gradients.
argv: draft vocab size, chunk, and "compiled" for the chunk functions through torch.compile."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from eyas.draft.fused_loss import fused_ttt_loss
from eyas.draft.loss import TargetHead
from eyas.draft.model import DraftConfig, Eagle3Draft, RMSNorm
from eyas.train import parallel


def main() -> None:
    dv, chunk = int(sys.argv[1]), int(sys.argv[2])
    compiled = sys.argv[3:] == ["compiled"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    h, vocab, k = 32, 50, 3
    cfg = DraftConfig(
        hidden_size=h,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=vocab,
        draft_vocab_size=dv,
        aux_layer_ids=[1, 2, 3],
        target_hidden_size=h,
    )
    model = Eagle3Draft(cfg).double()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    ids = torch.randperm(vocab)[:dv].sort().values
    head = TargetHead(
        torch.rand(h, dtype=torch.float64) + 0.5,
        torch.randn(vocab, h, dtype=torch.float64),
        ids - torch.arange(dv),
        1e-6,
    )
    batches = []
    for r in range(world):  # the same on every rank: rank r trains on batches[r]
        b, t = (2, 17) if r != 1 else (1, 4)  # rank 1: T = 4, no position for TTT step 2
        doc = torch.zeros(b, t, dtype=torch.long)
        doc[0, t // 2 :] = 1
        batches.append(
            dict(
                aux=torch.randn(b, t, 3 * h, dtype=torch.float64),
                x=torch.randint(0, vocab, (b, t)),
                pos=torch.arange(t).repeat(b, 1),
                doc=doc,
                mask=torch.rand(b, t) > 0.3,
                final=torch.randn(b, t, h, dtype=torch.float64) * 3,
            )
        )

    def loss_of(m, bt):
        normed = m(bt["aux"], bt["x"], bt["pos"], bt["doc"], k, return_normed=True)
        return fused_ttt_loss(
            normed,
            m.lm_head.weight,
            head,
            bt["final"],
            bt["mask"],
            bt["doc"],
            0.8,
            chunk=chunk,
            compiled=compiled and isinstance(m.lm_head.weight, DTensor),
        )

    ref = copy.deepcopy(model)
    ref_loss, ref_grads = [], {}
    for bt in batches:
        ref.zero_grad()
        loss, stats = loss_of(ref, bt)
        (loss / 2).backward()  # a gradient scale other than 1, as the trainer's grad_accum gives
        ref_loss.append((loss.detach(), stats))
        for n, p in ref.named_parameters():
            if p.grad is not None:
                ref_grads[n] = ref_grads.get(n, 0) + p.grad / world

    parallel.wrap(model, "fsdp2", world, torch.device("cpu"), fused_loss=True)
    assert isinstance(model.lm_head.weight, DTensor)
    for it in range(2):  # twice: lm_head is never unsharded, and FSDP2's state resets between steps
        model.zero_grad()
        loss, stats = loss_of(model, batches[rank])
        (loss / 2).backward()
        assert isinstance(model.lm_head.weight, DTensor)  # never gathered
        want, want_stats = ref_loss[rank]
        torch.testing.assert_close(loss.detach(), want, rtol=1e-6, atol=1e-7)
        for g, w in zip(stats, want_stats):
            assert int(g.count) == int(w.count) and int(g.correct) == int(w.correct), (rank, g, w)
            torch.testing.assert_close(g.loss_sum, w.loss_sum, rtol=1e-6, atol=1e-7)
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        assert set(got) == set(ref_grads) and "lm_head.weight" in got, (sorted(got), sorted(ref_grads))
        for n in ref_grads:
            # the CE is fp32 in both (summed in another order here): ~1e-6 apart
            torch.testing.assert_close(
                got[n], ref_grads[n], rtol=1e-5, atol=1e-6 * float(ref_grads[n].abs().max()), msg=f"rank {rank}: {n}"
            )
    with torch.no_grad():  # held-out evaluation: forward only, the same numbers
        loss, _ = loss_of(model, batches[rank])
        torch.testing.assert_close(loss, ref_loss[rank][0], rtol=1e-6, atol=1e-7)
    print(f"rank {rank} ok: lm_head rows {model.lm_head.weight.to_local().shape[0]} of {dv}", flush=True)
    dist.barrier()
    # Leave without running gloo's C++ destructors: at interpreter exit (and in destroy_process_group)
    # they race with the other rank's teardown and at times abort this one ("terminate called without
    # an active exception", SIGABRT) after every check has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
