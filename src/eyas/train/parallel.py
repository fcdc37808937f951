"""Data parallelism for the draft: DDP or FSDP2 (``fully_shard``), and full (unsharded) state I/O.

Checkpoints are the same whatever the mode: a full model state and an optimizer state in
``torch.optim.Optimizer.state_dict()`` form (integer parameter ids, in the order of the
trainable parameters), so a run saved under one mode resumes under any other.

FSDP2 layout. The draft is ONE decoder layer that the TTT unroll reuses ``ttt_steps`` times per
forward, through helper methods (``pre``/``qkv``/``post``), not through each module's own
``forward``. An FSDP2 unit re-gathers its parameters on every call and reduce-scatters after every
call's backward, so units inside the unroll would multiply communication by ``ttt_steps`` (and
methods other than ``forward`` would not unshard at all). So: ``fc`` (called once per forward) is
its own unit, then the root takes the rest (midlayer, norm, lm_head, the frozen embedding). The
root is gathered once per forward and reduced once per backward; what is sharded at rest is every
parameter, its gradient and its AdamW state, which is where the memory goes. The frozen embedding
is sharded too (FSDP2 shards per parameter; a frozen one gets no gradient and, not being in the
optimizer's list, no optimizer state). ``d2t``/``t2d`` are buffers: FSDP2 leaves buffers whole on
every rank.

With ``--fused-loss`` lm_head is a unit of its own, and the draft's forward returns the normed
hidden without calling it (``return_normed``): it is never all-gathered, and its weight stays the
sharded DTensor, which :mod:`eyas.draft.sharded_loss` scores shard by shard and whose gradient it
computes whole (the data-parallel mean: FSDP2 never unshards the unit, so it reduces nothing for
it). No rank ever holds lm_head whole, nor its gradient.

Precision: no ``MixedPrecisionPolicy``. bf16 autocast stays as in single-process and DDP runs
(fp32 master weights, fp32 gradient reduction), so the three modes compute the same numbers and a
checkpoint moves between them; a bf16 param_dtype would halve all-gather bytes but change the
numerics of the norms and the reduction.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eyas.errors import EyasError


@dataclass
class Dist:
    """This process's place among torchrun's (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def on(self) -> bool:
        return self.world > 1

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.on:
            torch.distributed.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.on:
            torch.distributed.barrier()


def setup_dist(device_arg: str) -> tuple[Dist, torch.device]:
    """The process group (under torchrun) and this rank's device from ``--device``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    if device_arg.startswith("cuda") and not torch.cuda.is_available():
        raise EyasError(f"--device {device_arg}: CUDA is not available here; use --device cpu")
    device = torch.device(f"cuda:{local}" if device_arg == "cuda" else device_arg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local), device


def teardown_dist() -> None:
    """End a finished rank's process group. NCCL's is destroyed. A gloo group of several ranks is
    left by ending the process at once, once every rank is done: its teardown, in
    destroy_process_group or at the interpreter's exit, races with the other ranks' and aborted a
    finished rank now and then (exit -6, so torchrun failed the job; docs/status.md). Callers print
    what they have to say before this."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_backend() == "gloo" and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()  # no rank leaves while another still needs it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    torch.distributed.destroy_process_group()


def wrap(model: nn.Module, parallel: str, world: int, device: torch.device, fused_loss: bool = False) -> nn.Module:
    """The module to train through: ``model`` itself (one process or FSDP2, which shards in
    place) or a DDP wrapper. Build the optimizer from ``model.parameters()`` AFTER this call.
    ``fused_loss`` under FSDP2: lm_head is its own unit, outside the root's all-gather (the module
    docstring)."""
    if world <= 1:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )  # d2t/t2d never change
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    fully_shard(model.fc, mesh=mesh)
    if fused_loss:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_sync(net: nn.Module, last_micro: bool):
    """Context for one micro-batch's backward: gradients are reduced only on the last one."""
    import contextlib

    if is_fsdp(net):
        net.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()
    if last_micro or not hasattr(net, "no_sync"):
        return contextlib.nullcontext()
    return net.no_sync()


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict (parameters + persistent buffers). Collective under FSDP2: every rank
    calls it; rank 0 gets the tensors (on CPU), the others an empty dict."""
    if not is_fsdp(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state in ``optim.state_dict()`` form (integer ids). Collective under FSDP2."""
    if not is_fsdp(model):
        return optim.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optim, options=_options())
    if not osd:  # not rank 0
        return {}
    ids = {name: i for i, name in enumerate(_trainable_names(model))}
    groups = []
    for g in osd["param_groups"]:
        groups.append({**g, "params": [ids[n] for n in g["params"]]})
    return {"state": {ids[n]: s for n, s in osd["state"].items()}, "param_groups": groups}


def load_optim_state(model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an ``optim.state_dict()``-form state (full, as saved) into ``optim``; under FSDP2 each
    rank keeps its shard of it."""
    if not is_fsdp(model):
        optim.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _trainable_names(model)
    n_saved = sum(len(g["params"]) for g in state["param_groups"])
    if n_saved != len(names):
        raise EyasError(
            f"the checkpoint's optimizer holds {n_saved} parameters, this draft trains "
            f"{len(names)}; resume with the same --draft-config, or start a new --out"
        )
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    fqn_state = {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optim, fqn_state, options=StateDictOptions(full_state_dict=True))


def local_norm(grad_norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor on every rank (a DTensor under FSDP2)."""
    full = getattr(grad_norm, "full_tensor", None)
    return full() if full is not None else grad_norm


def total_norm(grad_norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a DTensor under FSDP2)."""
    full = getattr(grad_norm, "full_tensor", None)
    return float(full() if full is not None else grad_norm)
