"""The builtin engine, and it on several processes sharing one device (`eyas evaluate --workers N`).

One verification round of the builtin loop is a chain of small kernels and a wait for the
device's verdict, so one process leaves a GPU mostly idle; N processes, each with its own target,
draft and CUDA context, fill it. Questions go to whichever worker is free, and each question's
records come back whole, so the records file resumes as with one process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterator

from eyas.evaluate.prompts import Question

_STATE: dict[str, Any] = {}  # the worker's engine and tokenizer, made once per process


def build_engine(
    target, draft_dir: Path, k: int, temperature: float, seed: int, compare_plain: bool, dtype: str, device: str
):
    """The builtin engine: ``target``'s HF model and the draft at ``dtype`` on ``device``."""
    import torch

    from eyas.draft.model import Eagle3Draft
    from eyas.evaluate.speculative import BuiltinEngine

    torch_dtype = getattr(torch, dtype)
    model = target.load_model(dtype=torch_dtype, device=device)
    draft = Eagle3Draft.from_pretrained(Path(draft_dir), device=device, dtype=torch_dtype, target_dir=target.path)
    return BuiltinEngine(model, draft, k, temperature, seed, compare_plain)


def _init(
    target,
    draft_dir: str,
    k: int,
    temperature: float,
    seed: int,
    compare_plain: bool,
    dtype: str,
    device: str,
    threads: int,
) -> None:
    import torch

    torch.set_num_threads(threads)
    _STATE["engine"] = build_engine(target, Path(draft_dir), k, temperature, seed, compare_plain, dtype, device)
    _STATE["tokenizer"] = target.load_tokenizer()


def _answer(q: Question, max_new_tokens: int, stop_ids: set[int]) -> list[dict]:
    from eyas.evaluate.runner import answer_question

    return answer_question(_STATE["engine"], q, _STATE["tokenizer"], max_new_tokens, stop_ids)


class BuiltinPool:
    """``pool(questions)`` yields each question's records as a worker finishes it."""

    def __init__(
        self,
        workers: int,
        target,
        draft_dir: Path,
        k: int,
        temperature: float,
        seed: int,
        compare_plain: bool,
        dtype: str,
        device: str,
        max_new_tokens: int,
        stop_ids: set[int],
    ):
        self.threads = threads = max(1, (os.cpu_count() or 1) // workers)
        # spawn: CUDA cannot be used in a forked child
        self.exe = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(target, str(draft_dir), k, temperature, seed, compare_plain, dtype, device, threads),
        )
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids

    def __call__(self, questions: list[Question]) -> Iterator[list[dict]]:
        pending = {self.exe.submit(_answer, q, self.max_new_tokens, self.stop_ids) for q in questions}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()  # a worker's error stops the run here, with its traceback
        finally:
            for fut in pending:
                fut.cancel()

    def close(self, now: bool = False) -> None:
        """Wait for the workers to finish; with ``now`` (a stopped or failed run) end them at once.

        A question's records come back whole, so ending a worker mid-question loses only that
        question, which a resumed run redoes. Waiting for it instead held a stopped run for up to a
        question's length (a minute on the GPU with 16 workers), past any budget it was given.
        """
        if not now:
            self.exe.shutdown(wait=True, cancel_futures=True)
            return
        # ProcessPoolExecutor has no public way to end its workers before Python 3.14
        procs = list((getattr(self.exe, "_processes", None) or {}).values())
        self.exe.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():  # also when the executor's own thread reaped it first (poll sees no child)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
