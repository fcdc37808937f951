"""``vllm``: a hidden-states KV connector for the ``extract_hidden_states`` method, CPU and GPU.

vLLM's ``ExampleHiddenStatesConnector`` copies each finished request's states out of the
hidden-state cache on a CUDA stream into pinned host memory, which fails on CPU builds
("pin_memory=True requires a CUDA or other accelerator backend"). This subclass keeps the
stock path on CUDA and, when the cache lives on the host, copies synchronously and hands the
stock writer thread an already-completed event. It is loaded by vLLM's own connector
mechanism: ``kv_transfer_config={"kv_connector": "EyasHiddenStatesConnector",
"kv_connector_module_path": "eyas_vllm_worker.connector", ...}``; no vLLM file is patched.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a finished ``torch.cuda.Event`` when the copy already happened on the host."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
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
