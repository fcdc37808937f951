"""Packing samples into fixed token budgets, and the held-out split.

A pack is a list of sample indices whose lengths sum to at most the budget; documents never
attend to each other (doc ids + per-document positions), and the only padding is the pack's
unused tail, which first-fit-decreasing over shuffled windows keeps small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eyas.errors import EyasError

_WINDOW = 512  # samples packed together: large enough to fill packs, small enough to stay shuffled


def is_heldout(index: int, fraction: float) -> bool:
    """A fixed pseudo-random fraction of sample indices (Knuth multiplicative hash), same everywhere."""
    return ((index * 2654435761) % (1 << 32)) / float(1 << 32) < fraction


def split_indices(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of ``n`` samples."""
    held = np.array([is_heldout(i, fraction) for i in range(n)], dtype=bool)
    if fraction > 0 and not held.any() and n > 1:
        held[n - 1] = True  # tiny datasets still get one held-out sample
    idx = np.arange(n)
    return idx[~held], idx[held]


def pack_indices(indices: np.ndarray, lengths: np.ndarray, budget: int, seed: int | None) -> list[list[int]]:
    """Shuffle (when ``seed`` is given) and pack first-fit-decreasing within windows."""
    order = np.array(indices, dtype=np.int64)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(order)
    packs: list[list[int]] = []
    for start in range(0, len(order), _WINDOW):
        window = order[start : start + _WINDOW]
        lens = np.minimum(lengths[window], budget)
        bins: list[list[int]] = []
        free: list[int] = []
        for k in np.argsort(-lens, kind="stable"):
            need = int(lens[k])
            if need <= 0:
                continue
            for b, room in enumerate(free):
                if room >= need:
                    bins[b].append(int(window[k]))
                    free[b] -= need
                    break
            else:
                bins.append([int(window[k])])
                free.append(budget - need)
        packs.extend(bins)
    return packs


@dataclass
class PackLayout:
    """Token-level layout of a batch of packs, [B, T] each (T = budget)."""

    input_ids: torch.Tensor  # int64, 0 in padding
    loss_mask: torch.Tensor  # bool
    position_ids: torch.Tensor  # restart at 0 per document; padding counts 0.. as its own run
    doc_ids: torch.Tensor  # document number within the pack; -1 in padding
    spans: list[list[tuple[int, int, int, int]]]  # per pack: (sample index, start, length, kept)

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())


def layout(packs: list[list[int]], samples: dict[int, tuple[np.ndarray, np.ndarray]], budget: int) -> PackLayout:
    """Lay out packs (lists of sample indices) given each sample's (input_ids, loss_mask)."""
    b = len(packs)
    ids = np.zeros((b, budget), np.int64)
    mask = np.zeros((b, budget), bool)
    pos = np.zeros((b, budget), np.int64)
    doc = np.full((b, budget), -1, np.int64)
    spans = []
    for r, pack in enumerate(packs):
        at, row = 0, []
        for d, i in enumerate(pack):
            x, m = samples[i]
            n = min(len(x), budget - at)  # samples longer than the budget are truncated
            ids[r, at : at + n] = x[:n]
            mask[r, at : at + n] = m[:n]
            pos[r, at : at + n] = np.arange(n)
            doc[r, at : at + n] = d
            row.append((i, at, len(x), n))
            at += n
        pos[r, at:] = np.arange(budget - at)
        spans.append(row)
    return PackLayout(
        torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(pos), torch.from_numpy(doc), spans
    )


class EpochPlan:
    """Packs per epoch, and the mapping optimizer step -> (epoch, step within epoch)."""

    def __init__(
        self, train_idx: np.ndarray, lengths: np.ndarray, budget: int, batch: int, global_micro: int, seed: int
    ):
        self.train_idx, self.lengths, self.budget = train_idx, lengths, budget
        self.batch, self.global_micro, self.seed = batch, global_micro, seed
        self._packs: dict[int, list[list[int]]] = {}  # at most two epochs' packs
        self._counts: dict[int, int] = {}

    def packs(self, epoch: int) -> list[list[int]]:
        if epoch not in self._packs:
            if len(self._packs) >= 2:  # keep this and the neighbouring epoch (read-ahead crosses it)
                self._packs.pop(max(self._packs, key=lambda e: abs(e - epoch)))
            self._packs[epoch] = pack_indices(
                self.train_idx, self.lengths, self.budget, seed=self.seed * 100003 + epoch
            )
            self._counts[epoch] = len(self._packs[epoch])
        return self._packs[epoch]

    def steps_in(self, epoch: int) -> int:
        if epoch not in self._counts:
            self._counts[epoch] = len(
                pack_indices(self.train_idx, self.lengths, self.budget, seed=self.seed * 100003 + epoch)
            )
        return self._counts[epoch] // (self.batch * self.global_micro)

    def epochs_at(self, steps: int) -> float:
        """Passes over the training split that ``steps`` optimizer steps make (fractional)."""
        epoch, off = self.locate(steps)
        return epoch + off / max(1, self.steps_in(epoch))

    def locate(self, step: int) -> tuple[int, int]:
        epoch = 0
        while step >= self.steps_in(epoch):
            if self.steps_in(epoch) == 0:
                raise EyasError(
                    "the training split is smaller than one global batch "
                    f"({self.batch * self.global_micro} packs of {self.budget} tokens); "
                    "lower --tokens-per-batch/--grad-accum or add data"
                )
            step -= self.steps_in(epoch)
            epoch += 1
        return epoch, step
