"""``vllm-hooks``: a vLLM worker extension that records the residual stream with forward hooks.

Loaded by vLLM itself through ``LLM(worker_extension_cls="eyas_vllm_worker.hooks.EyasHookExtension")``
and driven through ``LLM.collective_rpc``; it touches only the worker's model (``nn.Module``
hooks), never the scheduler, requests, KV cache or executor.

Attribution: a hook sees the flattened tokens of a whole batch, in an order vLLM chooses. A
pre-hook on the base model records the ``input_ids`` and ``positions`` of every step; prefill-only
requests without chunked prefill or prefix caching appear as runs of positions 0..T-1, and each
run is matched to the expected prompt with exactly those tokens. A row can therefore only be
stored under a prompt whose tokens it was computed from; anything unmatched is reported.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import nn

from .chunks import write_chunk


def _decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """(base model, decoder layers) of a vLLM CausalLM (``.model`` or ``.language_model.model``)."""
    cands = [model, getattr(model, "model", None), getattr(model, "language_model", None)]
    lm = getattr(model, "language_model", None)
    if lm is not None:
        cands.append(getattr(lm, "model", None))
    for c in cands:
        layers = getattr(c, "layers", None)
        if isinstance(c, nn.Module) and isinstance(layers, nn.ModuleList) and len(layers):
            return c, layers
    raise RuntimeError(f"eyas: {type(model).__name__} has no decoder with a `layers` list")


def _stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    # vLLM layers carry the residual stream split in two; layer 0 gets residual=None.
    return hidden if residual is None else hidden + residual


class _Recorder:
    def __init__(self, base: nn.Module, layers: nn.ModuleList, aux: list[int], final: int):
        self.aux, self.final = aux, final
        self.num_slots = len(aux) + 1
        self.expected: dict[bytes, list[int]] = defaultdict(list)
        self.captured: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.stray = 0  # prompt-start runs that matched nothing (or runs not starting at 0)
        self._step: dict | None = None
        # The base model's own __call__ may be replaced by vLLM's compile wrapper (bypassing
        # module hooks), so the step's token ids are taken at the embedding, a plain module.
        embed = getattr(base, "embed_tokens", None)
        if not isinstance(embed, nn.Module):
            raise RuntimeError(f"eyas: {type(base).__name__} has no embed_tokens module to read token ids from")
        self.handles = [embed.register_forward_pre_hook(self._on_embed, with_kwargs=True)]
        for slot, k in enumerate(aux):
            self.handles.append(layers[k].register_forward_pre_hook(self._on_layer(slot), with_kwargs=True))
        self.handles.append(layers[final - 1].register_forward_hook(self._on_last, with_kwargs=True))

    def _on_embed(self, module, args, kwargs):
        ids = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point:
            self._step = None  # embeddings given directly: cannot attribute, so record nothing
            return
        self._step = {"ids": ids.detach().reshape(-1).to("cpu", torch.int64), "states": [None] * self.num_slots}

    def _on_layer(self, slot: int):
        def hook(module, args, kwargs):
            if self._step is None:
                return
            hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            self._step["states"][slot] = _stream(hidden, residual).detach()

        return hook

    def _on_last(self, module, args, kwargs, output):
        if self._step is None:
            return
        pos = args[0] if args else kwargs.get("positions")
        if pos.dim() == 2:  # M-RoPE positions [3, T]: the text position is row 0
            pos = pos[0]
        self._step["pos"] = pos.detach().reshape(-1).to("cpu", torch.int64)
        if isinstance(output, (tuple, list)):
            st = _stream(output[0], output[1] if len(output) > 1 else None)
        else:
            st = output
        self._step["states"][-1] = st.detach()
        step, self._step = self._step, None
        if any(s is None for s in step["states"]):
            return
        n = step["ids"].numel()
        states = torch.stack([s[:n] for s in step["states"]], dim=1).to("cpu")  # [T, L, H]
        self._split(step["ids"], step["pos"][:n], states)

    def _split(self, ids: torch.Tensor, pos: torch.Tensor, states: torch.Tensor) -> None:
        p = pos.numpy()
        breaks = np.flatnonzero(p[1:] != p[:-1] + 1) + 1
        bounds = [0, *breaks.tolist(), len(p)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if p[a] != 0:
                self.stray += 1
                continue
            run = ids[a:b]
            waiting = self.expected.get(run.numpy().tobytes())
            if not waiting:
                self.stray += 1
                continue
            index = waiting.pop(0)
            self.captured.append((index, run.clone(), states[a:b].clone()))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class EyasHookExtension:
    """Methods vLLM mixes into its worker class; call them with ``llm.collective_rpc(name, ...)``."""

    def _eyas_model(self) -> nn.Module:
        runner = self.model_runner
        get = getattr(runner, "get_model", None)
        return get() if callable(get) else runner.model

    def _eyas_is_writer(self) -> bool:
        # Tensor parallel ranks hold the same (all-reduced) residual stream: rank 0 writes.
        rank = getattr(self, "rank", None)
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        return not rank

    def eyas_install(self, aux: list[int], final: int, out_dir: str, tag: str = "0") -> dict:
        """Install the hooks (writer rank only); returns facts about the model for the caller."""
        base, layers = _decoder(self._eyas_model())
        if final != len(layers):
            raise RuntimeError(f"eyas: final id {final} but the model has {len(layers)} layers")
        old = getattr(self, "_eyas_rec", None)
        if old is not None:
            old.remove()
        self._eyas_rec = _Recorder(base, layers, list(aux), final) if self._eyas_is_writer() else None
        self._eyas_out, self._eyas_tag, self._eyas_seq = out_dir, tag, 0
        return {
            "num_layers": len(layers),
            "writer": self._eyas_rec is not None,
            "model_class": type(self._eyas_model()).__name__,
        }

    def eyas_expect(self, prompts: list) -> int:
        """Register ``[[index, token_ids], ...]`` as the prompts the next ``generate`` will run."""
        rec = self._eyas_rec
        if rec is None:
            return 0
        for index, ids in prompts:
            rec.expected[np.asarray(ids, dtype=np.int64).tobytes()].append(int(index))
        return len(prompts)

    def eyas_flush(self, name: str | None = None) -> dict | None:
        """Write what was captured as one chunk (``name``, default the tag and a count); report
        indices still missing (None on non-writers)."""
        rec = self._eyas_rec
        if rec is None:
            return None
        written = [i for i, _, _ in rec.captured]
        if rec.captured:
            name = name or f"{self._eyas_tag}-{self._eyas_seq:06d}"
            write_chunk(
                self._eyas_out, name, rec.captured, meta={"aux": rec.aux, "final": rec.final, "backend": "vllm-hooks"}
            )
            self._eyas_seq += 1
        missing = sorted(i for lst in rec.expected.values() for i in lst)
        report = {"written": written, "missing": missing, "stray_runs": rec.stray}
        rec.captured, rec.stray = [], 0
        rec.expected.clear()
        return report

    def eyas_remove(self) -> None:
        rec = getattr(self, "_eyas_rec", None)
        if rec is not None:
            rec.remove()
        self._eyas_rec = None
