"""Where the target's features come from: an extraction store (offline) or the target itself (online).

Both give the same :class:`Batch` for a list of packs, so the trainer does not know which ran.
The checks here refuse features from another target, tokenizer, dataset or layer set.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.features.format import dequantize
from eyas.train.packing import PackLayout, layout


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B,T]
    loss_mask: torch.Tensor  # [B,T] bool
    position_ids: torch.Tensor  # [B,T]
    doc_ids: torch.Tensor  # [B,T], -1 in padding
    aux: torch.Tensor  # [B,T,num_aux*H]
    final: torch.Tensor  # [B,T,H] pre-norm last-layer state
    num_tokens: int  # real (non-padding) tokens
    layout: PackLayout  # the same [B,T] tensors on the host (the loss's positions come from them)


class FeatureSource(Protocol):
    aux_layers: list[int]
    hidden_size: int

    def batch(self, packs: list[list[int]]) -> Batch: ...

    def prefetch(self, packs: list[list[int]]) -> None: ...


def _samples(dataset, packs: list[list[int]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for pack in packs:
        for i in pack:
            s = dataset[i]
            out[i] = (s.input_ids, s.loss_mask)
    return out


def pinned(lay: PackLayout, device: torch.device) -> PackLayout:
    """``lay`` with page-locked tensors when ``device`` is CUDA: a copy from pageable memory waits
    for all the work queued on the device first, which stops the host from preparing the next step
    while the device runs this one."""
    if device.type != "cuda":
        return lay
    return replace(
        lay,
        input_ids=lay.input_ids.pin_memory(),
        loss_mask=lay.loss_mask.pin_memory(),
        position_ids=lay.position_ids.pin_memory(),
        doc_ids=lay.doc_ids.pin_memory(),
    )


def _to(lay: PackLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device, non_blocking=True) for t in (lay.input_ids, lay.loss_mask, lay.position_ids, lay.doc_ids))


class OnlineFeatures:
    """The target runs in the same job; its hooks give the features per batch, nothing touches disk.

    Packed documents stay apart because positions restart per document: transformers turns
    restarting position_ids into a block-causal mask (checked by the tests).
    """

    def __init__(
        self, target, dataset, aux_layers: list[int] | None, device: torch.device, dtype: torch.dtype, budget: int
    ):
        from eyas.features.capture import HiddenStateCapture

        self.dataset, self.device, self.budget = dataset, device, budget
        self.model = target.load_model(dtype=dtype, device=str(device))
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.capture = HiddenStateCapture(self.model, aux_layers)
        self.aux_layers = list(self.capture.aux_layers)
        self.hidden_size = self.capture.hidden_size

    def batch(self, packs: list[list[int]]) -> Batch:
        lay = pinned(layout(packs, _samples(self.dataset, packs), self.budget), self.device)
        ids, mask, pos, doc = _to(lay, self.device)
        states = self.capture.capture_into(ids, position_ids=pos)
        # clone outside inference mode so autograd may save these as inputs of fc
        aux = states[:, :, :-1].flatten(2).clone()
        final = states[:, :, -1].clone()
        return Batch(ids, mask, pos, doc, aux, final, lay.num_tokens, lay)

    def prefetch(self, packs: list[list[int]]) -> None:
        """Nothing to do ahead: the target runs on the device in order."""


class OfflineFeatures:
    """Features read from an extraction store (interface B), checked against target and dataset."""

    def __init__(
        self,
        store_path,
        target,
        dataset,
        aux_layers: list[int] | None,
        device: torch.device,
        dtype: torch.dtype,
        budget: int,
    ):
        from eyas.features.reader import open_store

        self.reader = open_store(store_path)
        m = self.reader.manifest
        check_store_manifest(m, store_path, target, dataset, aux_layers)
        self.aux_layers = list(m["aux_layers"])
        self.hidden_size = int(m["hidden_size"])
        self.dataset, self.device, self.dtype, self.budget = dataset, device, dtype, budget
        stored = set(int(i) for i in self.reader.indices)
        missing = [i for i in range(len(dataset)) if i not in stored]
        if missing:
            raise EyasError(
                f"store {store_path}: {len(missing)} of {len(dataset)} samples of the "
                f"dataset are not stored (first: {missing[:5]}); finish `eyas extract` "
                "(re-run it to resume) before training"
            )

        # one background thread reads the next batch from the store while the device trains, and on
        # CUDA copies it to the device on a stream of its own: on the training stream the copy (150 MB
        # for 16 packs of 2,048 tokens) held up the kernels for 3% of an H200 step
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eyas-store")
        self._ahead: dict[tuple, Future] = {}
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def prefetch(self, packs: list[list[int]]) -> None:
        key = _key(packs)
        if key not in self._ahead:
            self._ahead[key] = self._pool.submit(self._load, packs)

    def batch(self, packs: list[list[int]]) -> Batch:
        fut = self._ahead.pop(_key(packs), None)
        lay, aux, final, moved = fut.result() if fut is not None else self._load(packs)
        if moved is None:
            ids, mask, pos, doc = _to(lay, self.device)
            return Batch(ids, mask, pos, doc, aux.to(self.device), final.to(self.device), lay.num_tokens, lay)
        tensors, copied = moved
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)  # the device waits for the copy, the host does not
        for x in tensors:
            x.record_stream(stream)  # their memory is not reused before this stream is done with them
        ids, mask, pos, doc, aux, final = tensors
        return Batch(ids, mask, pos, doc, aux, final, lay.num_tokens, lay)

    def _load(self, packs: list[list[int]]) -> tuple[PackLayout, torch.Tensor, torch.Tensor, tuple | None]:
        lay = layout(packs, _samples(self.dataset, packs), self.budget)
        b, t = lay.input_ids.shape
        a, h = len(self.aux_layers), self.hidden_size
        store = self.reader.layout
        # the batch is assembled as stored: an fp8 store's values and scales are decoded only after
        # the copy to the device (half the bytes cross, and the host does no per-element work)
        hidden = torch.zeros((b, t, a + 1, h), dtype=store.state_dtype if store.quantized else self.dtype)
        scale = torch.zeros((b, t, a + 1, store.scale_groups), dtype=torch.float32) if store.quantized else None
        for r, row in enumerate(lay.spans):
            for i, start, length, kept in row:
                s = self.reader.raw(i)
                if s.input_ids.shape[0] != length or not torch.equal(
                    s.input_ids[:kept].long(), lay.input_ids[r, start : start + kept]
                ):
                    raise EyasError(
                        f"store sample {i}: its tokens differ from the prepared dataset's; "
                        "the store was extracted from another dataset: re-run `eyas extract`"
                    )
                hidden[r, start : start + kept] = s.hidden[:kept]
                if scale is not None:
                    scale[r, start : start + kept] = s.scale[:kept]
        if self._copy_stream is None:
            aux, final = self._split(hidden, scale)
            return lay, aux, final, None
        lay = pinned(lay, self.device)
        hidden = hidden.pin_memory()
        scale = scale.pin_memory() if scale is not None else None
        with torch.cuda.stream(self._copy_stream):
            aux, final = self._split(
                hidden.to(self.device, non_blocking=True),
                None if scale is None else scale.to(self.device, non_blocking=True),
            )
            tensors = [*_to(lay, self.device), aux, final]
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        return lay, aux, final, (tensors, copied)

    def _split(self, hidden: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,T,A+1,H] (fp8 decoded with its scales, in fp32, then cast) -> aux [B,T,A*H], final [B,T,H]."""
        if scale is not None:
            hidden = dequantize(hidden, scale, self.dtype)
        return hidden[:, :, :-1].flatten(2), hidden[:, :, -1].contiguous()


def _key(packs: list[list[int]]) -> tuple:
    return tuple(tuple(p) for p in packs)


def check_store_manifest(m: dict, store_path, target, dataset, aux_layers: list[int] | None) -> None:
    """Refuse a store from another target, tokenizer, dataset or layer set, naming which."""
    found = m.get("target") or {}
    for key, what in (
        ("tokenizer", "tokenizer"),
        ("config", "target config"),
        ("weights", "target weights"),
        ("id", "target"),
    ):
        if found.get(key) != target.identity.get(key):
            from eyas.target import identity_scheme_note

            raise EyasError(
                f"store {store_path} was extracted with another {what} "
                f"({key} {found.get(key)!r} there, {target.identity.get(key)!r} for "
                f"{target.spec})."
                + identity_scheme_note(found, target.identity)
                + " Re-run `eyas extract` with this target"
            )
    want_ds = dataset.manifest.get("id")
    got_ds = m.get("prepared_id")
    if want_ds and got_ds and got_ds != want_ds:
        raise EyasError(
            f"store {store_path} was extracted from another prepared dataset (id {got_ds!r} "
            f"there, {want_ds!r} for {dataset.path}); pass the matching --data or re-extract"
        )
    if aux_layers and sorted(aux_layers) != sorted(m.get("aux_layers", [])):
        raise EyasError(
            f"store {store_path} holds layers {m.get('aux_layers')}, but layers "
            f"{sorted(aux_layers)} were asked for; drop --layers or re-extract with them"
        )
    conv = m.get("convention")
    from eyas.features.layers import CONVENTION

    if conv and conv != CONVENTION:
        raise EyasError(
            f"store {store_path} uses layer convention {conv!r}, eyas trains on "
            f"{CONVENTION!r}; re-extract with this eyas"
        )
