"""Tau measured while the draft trains (``--tau``): the replay engine (:mod:`eyas.evaluate.replay`)
on a fixed prompt set, run on the training device between steps.

The target's greedy answers to the prompts do not depend on the draft, so they are decoded once per
target, prompts and length and kept in eyas's cache (``EYAS_CACHE/replay/``), shared by every run.
A measurement is then one target forward and one draft unroll per turn: greedy tau at each k of
``--tau-k``. The draft is measured as evaluate loads it: a copy in the target's dtype (bf16 on a GPU),
so the figure is what `eyas evaluate --engine replay` gives for the same draft and prompts.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from eyas.evaluate.prompts import read_questions

TAU_FILE = "tau.json"  # beside the draft's weights: the last measurement, TAU_KEYS of it
TAU_KEYS = ("step", "tau", "turns", "questions", "prompts", "max_new_tokens")

# questions whose answers are decoded together: the default part of MT-bench in one batch
REFERENCE_BATCH = 64


class TauProbe:
    """Replays the draft being trained on ``questions``' reference answers; built before the
    training clock starts, so that decoding the references never counts as training time."""

    def __init__(self, cfg, target, model, device: torch.device, progress: bool):
        from eyas.data.chat import stop_token_ids
        from eyas.evaluate.replay import reference_settings, shared_references, target_references
        from eyas.fsio import sha256_file

        self.ks, self.max_new_tokens = sorted(set(cfg.tau_k)), cfg.tau_max_new_tokens
        self.prompts = Path(cfg.tau_prompts)
        self.questions = read_questions(self.prompts, None, cfg.tau_per_category or None)
        dtype = "bfloat16" if device.type == "cuda" and cfg.precision != "fp32" else "float32"
        self.dtype = getattr(torch, dtype)
        # the target of --features online is already here (its hooks are idle between batches)
        self.model = model if model is not None else target.load_model(dtype=self.dtype, device=str(device))
        tokenizer = target.load_tokenizer()
        self.stop_ids = set(stop_token_ids(tokenizer, target.path))
        # by content, not path: a cached file is reused wherever the same prompts live
        settings = reference_settings(
            target.id, self.max_new_tokens, dtype, f"sha256:{sha256_file(self.prompts)}", str(device), self.ks
        )
        self.references_path = shared_references(settings)
        t = time.perf_counter()
        self.references = target_references(
            self.model,
            tokenizer,
            self.questions,
            self.stop_ids,
            self.max_new_tokens,
            self.references_path,
            settings,
            REFERENCE_BATCH,
            progress,
        )
        self.references_s = time.perf_counter() - t

    def measure(self, draft) -> dict[str, Any]:
        """Tau per k of the draft as it is now."""
        from eyas.evaluate.replay import replay
        from eyas.evaluate.report import aggregate

        t = time.perf_counter()
        served = copy.deepcopy(draft).to(self.dtype)  # as evaluate and vLLM load it
        by_k = replay(self.model, served, self.references, self.ks, self.max_new_tokens, self.stop_ids, progress=False)
        del served
        return {
            "tau": {str(k): aggregate(recs, k)["tau"] for k, recs in by_k.items()},
            "turns": len(self.references),
            "questions": len(self.questions),
            "prompts": str(self.prompts),
            "max_new_tokens": self.max_new_tokens,
            "seconds": round(time.perf_counter() - t, 2),
        }
