"""Capture the target's residual stream with forward hooks (interface B, DESIGN.md section 2).

Only the chosen layers are recorded, never all of them, and only the base model runs (no
lm_head, no logits). id k < N is the input of decoder layer k (a forward *pre*-hook on
``layers[k]``); id N is the output of the last layer, taken before the final norm (a forward
hook on ``layers[N-1]``). Works for any decoder whose blocks live in a ``layers`` ModuleList
(Llama, Qwen2/3, Gemma3, Mistral, DeepSeek-V2/V3, ...), on any device.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from eyas.errors import EyasError
from eyas.features.layers import resolve_layers


def find_decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """Return (base model, its decoder layers) for a CausalLM, a base model or a VLM wrapper."""
    candidates: list[nn.Module] = [model]
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(get_decoder())
        except (AttributeError, NotImplementedError):
            pass
    for name in ("model", "language_model", "transformer"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module):
            candidates.append(sub)
            inner = getattr(sub, "language_model", None)
            if isinstance(inner, nn.Module):
                candidates.append(inner)
    for cand in candidates:
        layers = getattr(cand, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return cand, layers
    raise EyasError(
        f"model {type(model).__name__}: found no decoder with a `layers` ModuleList "
        "(looked at the model, get_decoder(), .model and .language_model); eyas's HF "
        "backend supports decoders whose blocks live in such a list"
    )


class HiddenStateCapture:
    """Forward hooks that record aux states and the final (pre-norm) state.

    ``capture()`` runs the base model once and returns ``(aux [B,T,A,H], final [B,T,H])``, both
    views into one ``[B,T,A+1,H]`` buffer (slot A is the final state), so a caller can move all
    states to the host with a single copy (``capture_into``). Outside ``capture()`` the hooks
    also record while the full model runs (e.g. generation with a KV cache): use ``recording()``.
    """

    def __init__(self, model: nn.Module, aux_layers: list[int] | None = None):
        self.model = model
        self.decoder, self.layers = find_decoder(model)
        n = len(self.layers)
        self.aux_layers, self.final_layer = resolve_layers(n, aux_layers)
        self.num_slots = len(self.aux_layers) + 1
        self._out: torch.Tensor | None = None  # buffer being filled by capture_into()
        self._alloc = False  # allocate _out lazily from the first state
        self._pending: dict[int, torch.Tensor] = {}
        self._seen: set[int] = set()
        self._records: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._handles = []
        for slot, k in enumerate(self.aux_layers):
            self._handles.append(self.layers[k].register_forward_pre_hook(self._pre_hook(slot), with_kwargs=True))
        self._handles.append(
            self.layers[n - 1].register_forward_hook(self._post_hook(self.num_slots - 1), with_kwargs=True)
        )

    # ------------------------------------------------------------------------------ hooks

    def _pre_hook(self, slot: int):
        def hook(module, args, kwargs):
            hs = args[0] if args else kwargs.get("hidden_states")
            self._put(slot, hs)

        return hook

    def _post_hook(self, slot: int):
        def hook(module, args, kwargs, output):
            hs = output[0] if isinstance(output, (tuple, list)) else output
            self._put(slot, hs)
            if self._out is None and self._records is not None:
                self._finish_record()

        return hook

    def _put(self, slot: int, hs: torch.Tensor) -> None:
        if not isinstance(hs, torch.Tensor):
            raise EyasError(
                f"hook on layer slot {slot}: expected a hidden-state tensor, got "
                f"{type(hs).__name__}; this decoder's layer signature is unsupported"
            )
        if self._alloc and self._out is None:
            b, t, h = hs.shape
            self._out = torch.empty((b, t, self.num_slots, h), dtype=hs.dtype, device=hs.device)
        if self._out is not None:
            self._out[:, :, slot].copy_(hs)
            self._seen.add(slot)
        elif self._records is not None:
            self._pending[slot] = hs.detach()

    def _finish_record(self) -> None:
        if len(self._pending) != self.num_slots:  # e.g. a forward that skipped layers
            self._pending.clear()
            return
        states = torch.stack([self._pending[s] for s in range(self.num_slots)], dim=2)
        self._pending.clear()
        self._records.append((states[:, :, :-1], states[:, :, -1]))

    # ------------------------------------------------------------------------------ API

    @property
    def hidden_size(self) -> int:
        cfg = getattr(self.decoder, "config", None) or getattr(self.model, "config")
        return int(cfg.hidden_size)

    @torch.inference_mode()
    def capture_into(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the base model; return the states as one ``[B,T,A+1,H]`` tensor (``out`` if given).

        With a left-padded ``attention_mask`` and no ``position_ids``, positions restart at 0 on
        each row's first real token, so every row gets the states it would get alone.
        """
        if attention_mask is not None and position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        self._out, self._alloc, self._seen = out, out is None, set()
        try:
            self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            result = self._out
        finally:
            self._out, self._alloc = None, False
        if result is None or len(self._seen) != self.num_slots:
            missing = [i for i in range(self.num_slots) if i not in self._seen]
            raise EyasError(
                f"model {type(self.model).__name__}: hooks for slots {missing} did not "
                "fire during the forward pass; the decoder does not call its layers "
                "as expected, so the HF backend cannot capture it"
            )
        return result

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(aux [B,T,num_aux,H], final [B,T,H])`` for ``input_ids`` (views of one buffer)."""
        states = self.capture_into(input_ids, attention_mask, position_ids)
        return states[:, :, :-1], states[:, :, -1]

    @contextmanager
    def recording(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Record ``(aux, final)`` of every forward pass run inside the block (e.g. ``generate``)."""
        self._records, self._pending = [], {}
        try:
            yield self._records
        finally:
            self._records = None
            self._pending = {}

    def remove(self) -> None:
        """Detach the hooks; the model is as it was before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "HiddenStateCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
