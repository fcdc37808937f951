"""``vllm``: a hidden-states KV connector for the ``extract_hidden_states`` method, CPU and GPU.

vLLM's ``ExampleHiddenStatesConnector`` copies each finished request's states out of the
hidden-state cache on a CUDA stream into pinned host memory, which fails on CPU builds
("pin_memory=True requires a CUDA or other accelerator backend"). This subclass keeps the
stock path on CUDA and, when the cache lives on the host, copies synchronously and hands the
stock writer thread an already-completed event. It is loaded by vLLM's own connector
mechanism: ``kv_transfer_config={"kv_connector": "EyasHiddenStatesConnector",
"kv_connector_module_path": "eyas_vllm_worker.connector", ...}``; no vLLM file is patched.

Where the stock class makes that copy differs by release, so which method is replaced is
decided by what the stock class has, not by its version number:

- ``_submit_async_write`` (called from ``get_finished``; seen in 0.24-0.32): replaced below.
- no such method, but a ``_pending_copies`` queue filled by ``save_kv_layer`` and drained by
  ``wait_for_save`` (seen in 0.22): ``save_kv_layer`` is replaced, queueing host copies.
- neither (0.18, 0.20): the stock ``save_kv_layer`` copies with ``.cpu()`` and writes the file
  itself, which works on the host as it is.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

# True where the stock class copies in get_finished (>= 0.24); False where save_kv_layer does.
STOCK_HAS_SUBMIT_ASYNC_WRITE = hasattr(ExampleHiddenStatesConnector, "_submit_async_write")


class _Done:
    """Stands in for a finished ``torch.cuda.Event`` when the copy already happened on the host."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        # Only called by stock classes that have the method (STOCK_HAS_SUBMIT_ASYNC_WRITE).
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache
        if cache is None or cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        # clone: the cache blocks are freed (and reused) once the request reports done.
        states = extract_from_kv_cache(cache, slots, n).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if (
            STOCK_HAS_SUBMIT_ASYNC_WRITE
            or not hasattr(self, "_pending_copies")
            or kv_layer.device.type == "cuda"
            or layer_name not in self.cache_layers
        ):
            return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        # The stock queue-in-save_kv_layer flavour (0.22) records torch.cuda.Events here; on the
        # host the copy is made now and the stock wait_for_save hands it to the writer threads.
        # The stock method reads the same slot mapping from vLLM's forward context (an internal).
        slot_mapping = getattr(attn_metadata, "slot_mapping", None)
        if slot_mapping is None:
            raise RuntimeError(
                f"eyas connector: the hidden-states layer's metadata "
                f"({type(attn_metadata).__name__}) has no slot_mapping in this vLLM; "
                "use --backend vllm-hooks or another vLLM version"
            )
        os.makedirs(self._storage_path, exist_ok=True)
        offset = 0
        for request in self._get_connector_metadata().requests:
            n = request.token_ids.shape[0]
            # clone: the slot rows are reused once the request's blocks are freed
            states = extract_from_kv_cache(kv_layer, slot_mapping[offset : offset + n], n).clone()
            offset += n
            tensors = {"hidden_states": states, "token_ids": request.token_ids.clone()}
            self._pending_copies.append((tensors, _Done(), request.filename, request.req_id))
