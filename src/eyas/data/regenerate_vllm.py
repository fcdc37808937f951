"""The vLLM engines behind `eyas prepare --regenerate --gen-backend vllm`.

One or more engine processes for the whole regeneration, in the vLLM interpreter (found like
extraction's: ``--vllm-python``, ``$EYAS_VLLM_PYTHON``, this Python, or the newest ``.venvs/vllm-*``).
eyas sends token ids and gets token ids back, so the prompts are exactly what the HF backend would
feed, and decoding (stop tokens, empty answers) is shared with it.

The engines are kept full: each holds up to ``in_flight`` prompts and is sent more whenever fewer
than half are left, and an answer's next turn joins the queue as soon as the answer is back. With
``engines`` > 1 several engines share the GPU(s), each with its share of the memory: a small
target leaves one engine's scheduler, not the GPU, as the limit. All engine processes start at
once and import vLLM side by side, but engine j > 0 builds its engine only once engine j-1 is ready
(vLLM's memory profiling must not see another engine starting), while the ready ones already
generate.
"""

from __future__ import annotations

import queue
import shutil
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable

from eyas.errors import EyasError
from eyas.vllm import VLLM_DTYPES
from eyas.vllm.find import find_vllm_python, probe_vllm
from eyas.vllm.placement import visible_gpus
from eyas.vllm.process import WorkerProcess

# (key, prompt ids, seed) -> on_answer(key, token ids) returns the follow-up items
Item = tuple[Any, list[int], int]


class VllmGenerator:
    """``run(items, on_answer)``: every item answered by one of ``engines`` vLLM engines."""

    def __init__(
        self,
        target_path: str | Path,
        work: Path,
        max_model_len: int,
        seed: int,
        vllm_python: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        engines: int = 1,
        max_num_seqs: int | None = None,
        in_flight: int = 1024,
        gpus: int = 0,
        gpu_memory_utilization: float = 0.85,
    ):
        python, why = find_vllm_python(vllm_python)
        inst = probe_vllm(python)
        if not inst.version:
            raise EyasError(f"{python} (chosen by {why}) has no vLLM; pass --vllm-python or use --gen-backend hf")
        self.python, self.in_flight = python, max(1, int(in_flight))
        self.describe = f"vLLM {inst.version} ({python}, chosen by {why})"
        self.work = Path(work).resolve()  # the engines run in it: a relative path would not reach it
        shutil.rmtree(self.work, ignore_errors=True)
        self.log_path = self.work.parent / "regenerate-vllm.log"  # outlives the work dir
        per_gpu = -(-engines * tensor_parallel_size // gpus) if gpus else engines  # engines on one GPU
        self.jobs = [
            {
                "model": str(target_path),
                "work_dir": str(self.work / f"engine-{j}"),
                "start_when_told": j > 0,
                "max_model_len": int(max_model_len),
                "seed": int(seed),
                "dtype": VLLM_DTYPES.get(dtype, dtype),
                "tensor_parallel_size": int(tensor_parallel_size),
                "gpu_memory_utilization": gpu_memory_utilization / per_gpu,
                "max_num_seqs": max_num_seqs,
            }
            for j in range(engines)
        ]
        self.gpus = gpus
        self.procs: list[WorkerProcess] = []
        self.closing = False
        self.replies: queue.Queue = queue.Queue()
        for j in range(engines):
            self._start(j)
        kind, j, ready = self.replies.get()
        if kind == "error":
            self.close()
            raise ready
        # vLLM's CPU runner cannot seed single requests; there the engine seed drives sampling
        self.per_request_seed = bool(ready.get("per_request_seed"))
        self.ready = [True] + [False] * (engines - 1)
        if engines > 1:
            self.procs[1].send({"op": "start"})

    def _start(self, j: int) -> None:
        env = None
        if self.gpus > 1:  # engines spread over the visible GPUs, tensor_parallel_size each
            tp = self.jobs[j]["tensor_parallel_size"]
            visible = visible_gpus()
            env = {"CUDA_VISIBLE_DEVICES": ",".join(visible[(j * tp + t) % self.gpus] for t in range(tp))}
        log = self.log_path if j == 0 else self.log_path.with_name(f"regenerate-vllm-{j}.log")
        proc = WorkerProcess(
            self.python,
            "generate",
            self.jobs[j],
            Path(self.jobs[j]["work_dir"]),
            log,
            multiprocessing=True,
            cwd=Path(self.jobs[j]["work_dir"]),
            env=env,
            describe=f"{self.describe}: generation engine {j}",
        )
        self.procs.append(proc)
        threading.Thread(target=self._read, args=(j, proc), daemon=True).start()

    def _read(self, j: int, proc: WorkerProcess) -> None:
        """Engine j's replies, in order, onto the one queue the caller waits on."""
        kind = "ready"
        while True:
            try:
                self.replies.put((kind, j, proc.read()))
            except (EyasError, ValueError) as e:  # ValueError: its log was closed by close()
                if not self.closing:  # an engine that quits when asked to is no error
                    self.replies.put(("error", j, e))
                return
            kind = "outputs"

    def run(
        self,
        items: list[Item],
        on_answer: Callable[[Any, list[int]], list[Item]],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
    ) -> None:
        todo = deque(items)
        live: list[dict[str, Any]] = [{} for _ in self.jobs]  # per engine: its unanswered items by key
        waiting = [False] * len(self.jobs)  # a request of it is out
        params = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": stop_token_ids,
        }
        while True:
            for j, proc in enumerate(self.procs):
                if not self.ready[j] or waiting[j] or not (todo or live[j]):
                    continue
                send = [todo.popleft() for _ in range(min(len(todo), self.in_flight - len(live[j])))]
                live[j].update((str(key), (key, ids)) for key, ids, _ in send)
                # refill at half: the engine's own queue never runs dry while this one has work
                low = self.in_flight // 2 if todo else len(live[j]) - 1
                proc.send(
                    {
                        "keys": [str(k) for k, _, _ in send],
                        "prompts": [p for _, p, _ in send],
                        "seeds": [s for _, _, s in send],
                        "low_water": low,
                        **params,
                    }
                )
                waiting[j] = True
            if not (todo or any(live) or any(waiting)):
                return
            kind, j, reply = self.replies.get()
            if kind == "error":
                raise reply
            if kind == "ready":
                self.ready[j] = True
                if j + 1 < len(self.jobs):
                    self.procs[j + 1].send({"op": "start"})
                continue
            waiting[j] = False
            for out in reply["outputs"]:
                key, _ = live[j].pop(out["key"])
                todo.extend(on_answer(key, out["token_ids"]))

    def close(self) -> None:
        self.closing = True
        for proc in self.procs:
            proc.close()
        shutil.rmtree(self.work, ignore_errors=True)
