"""Draft vocabulary: the most frequent trained-on target tokens, as DESIGN.md section 2 defines.

``d2t[i] = target_id(i) - i`` (int64 offsets, vLLM reads these) and ``t2d`` is a bool mask over
the target vocabulary. Draft ids are in ascending target-id order so ``d2t`` is well defined.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from eyas.errors import EyasError


def count_trained_tokens(
    input_ids: Iterable[np.ndarray], loss_masks: Iterable[np.ndarray], vocab_size: int
) -> np.ndarray:
    """Histogram (int64 [vocab_size]) of the tokens whose loss mask is set."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids, loss_masks):
        ids = np.asarray(ids)
        sel = ids[np.asarray(mask, dtype=bool)]
        if sel.size:
            if sel.max() >= vocab_size or sel.min() < 0:
                raise EyasError(
                    f"token id {int(sel.max())} is outside the target vocabulary of {vocab_size}; "
                    "the data was tokenized with another tokenizer: re-run prepare for this target"
                )
            counts += np.bincount(sel, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Pick the ``draft_vocab_size`` most frequent ids (ties -> lower id first).

    Zero-count ids sort after all seen ones by id, so when fewer distinct tokens were seen than
    the size, the lowest unused ids fill the rest and the size is exact.
    Returns ``(d2t int64 [draft], t2d bool [vocab], coverage)``; coverage is the share of
    trained-on tokens inside the draft vocab (1.0 when nothing was counted).
    """
    counts = np.asarray(counts, dtype=np.int64)
    vocab = counts.shape[0]
    if draft_vocab_size < 1:
        raise EyasError(f"--draft-vocab-size {draft_vocab_size}: must be at least 1")
    size = min(int(draft_vocab_size), vocab)
    # lexsort: last key is primary -> sort by -count, then by id.
    order = np.lexsort((np.arange(vocab), -counts))
    chosen = np.sort(order[:size])
    d2t = torch.from_numpy(chosen.astype(np.int64) - np.arange(size, dtype=np.int64))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    total = int(counts.sum())
    coverage = float(counts[chosen].sum() / total) if total else 1.0
    return d2t, t2d, coverage


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of each draft id (``i + d2t[i]``)."""
    return torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
