"""Built-in chain speculative decoding: an HF target (KV cache) verifies k tokens of an EAGLE-3 draft.

The loop mirrors vLLM's EAGLE-3 proposer so the two acceptance lengths can be compared:

* The draft keeps a KV cache of *committed* positions. Position i's entry is computed from the
  target's aux states at i and the embedding of token x[i+1].
* After each target forward (prefill or verification) the draft cache is cropped back to the
  committed length, and the draft runs once over every newly committed position (the target's
  features of the last accepted tokens, tokens shifted by one, the last one being the token the
  target just emitted). Its output at the last position gives draft token 1.
* Draft tokens 2..k come from TTT steps: the draft's own (pre-norm) hidden state of the previous
  step plus the previous draft token, at position +1 each step. These entries are speculative
  and are rolled back (cropped) before the next round.
* The target verifies [last emitted token, d1..dk] in one forward; its KV cache is cropped to
  the accepted prefix. The hooks of ``HiddenStateCapture`` record the aux states of that forward.

tau = tokens emitted per verification forward = 1 + accepted / rounds (vLLM's definition).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.evaluate.kv_cache import cache_kwargs
from eyas.evaluate.rejection import probs_at, verify_greedy, verify_sampling
from eyas.features.capture import HiddenStateCapture


@dataclass
class GenerationResult:
    """One generation: the emitted tokens and what the speculation did."""

    tokens: list[int]
    seconds: float
    rounds: int = 0  # verification forwards that carried drafts
    draft_tokens: int = 0  # k per round
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted count at draft position j

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else float("nan")


class TargetRunner:
    """The HF target with a KV cache that can be cropped after rejection."""

    def __init__(self, model, aux_layers: list[int] | None = None):
        from transformers import DynamicCache

        self.model = model
        self.capture = HiddenStateCapture(model, aux_layers) if aux_layers is not None else None
        self._cache_cls = DynamicCache
        self.cache = None
        self.length = 0  # committed positions in the target's KV cache

    def reset(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(
        self, tokens: list[int] | torch.Tensor, want_aux: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` (ids, or a [T] tensor already on the device) after the committed prefix;
        returns (logits [T,V], aux [T,A*H] or None).

        ``want_aux=False`` (plain decoding) leaves the hooks idle, so the baseline pays no capture."""
        dev = self.model.device
        ids = _ids(tokens, dev)
        pos = torch.arange(self.length, self.length + ids.shape[1], device=dev)[None]
        aux = None
        if self.capture is not None and want_aux:
            with self.capture.recording() as recs:
                out = self.model(
                    input_ids=ids, position_ids=pos, **cache_kwargs(self.model, self.cache), use_cache=True
                )
            a = recs[-1][0][0]  # [T, A, H]
            aux = a.reshape(a.shape[0], -1)
        else:
            out = self.model(input_ids=ids, position_ids=pos, **cache_kwargs(self.model, self.cache), use_cache=True)
        self.length += ids.shape[1]
        return out.logits[0], aux

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many
        self.length = length

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()


def _ids(tokens: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, T] ids on ``device``: a device tensor as it is (no copy, no wait for the device)."""
    if isinstance(tokens, torch.Tensor):
        return tokens.view(1, -1)
    return torch.tensor([tokens], dtype=torch.long, device=device)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(probs_at(logits, temperature), 1, generator=generator))


@torch.inference_mode()
def plain_generate(
    target: TargetRunner,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Ordinary one-token-per-forward decoding with the same KV cache (the speedup baseline)."""
    start = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt, want_aux=False)
    out = [_pick(logits[-1], temperature, generator)]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        logits, _ = target.forward([out[-1]], want_aux=False)
        out.append(_pick(logits[-1], temperature, generator))
    return GenerationResult(tokens=out, seconds=time.perf_counter() - start)


class DraftRunner:
    """The EAGLE-3 draft with its own KV cache of committed + speculative positions."""

    def __init__(self, draft):
        from eyas.draft.model import DraftKVCache

        self.draft = draft.eval()
        self._cache_cls = DraftKVCache
        self.cache = None
        self.committed = 0
        self.draft_to_target = draft.target_ids()
        self.vocab_size = int(draft.config.vocab_size)
        self.dtype = draft.fc.weight.dtype

    def reset(self) -> None:
        self.cache = self._cache_cls()
        self.committed = 0

    def _step(self, features: torch.Tensor, tokens: list[int] | torch.Tensor, start: int, from_target: bool):
        dev = self.draft_to_target.device
        ids = _ids(tokens, dev)
        pos = torch.arange(start, start + ids.shape[1], device=dev)[None]
        features = features.to(device=dev, dtype=self.dtype)
        logits, hidden = self.draft.step(features[None], ids, pos, self.cache, from_target=from_target)
        return logits[0, -1], hidden[0, -1:]

    def to_target_probs(self, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The draft's distribution scattered onto the target vocab (zero outside the draft vocab)."""
        q = torch.zeros(self.vocab_size, dtype=torch.float32, device=draft_logits.device)
        q[self.draft_to_target] = probs_at(draft_logits, temperature)
        return q

    @torch.inference_mode()
    def propose_greedy(self, aux: torch.Tensor, next_tokens: torch.Tensor, k: int) -> torch.Tensor:
        """:meth:`propose` at temperature 0, on the device throughout: ``next_tokens`` [n] and the
        k draft tokens returned (target ids, [k]) stay there, so the host queues the k draft steps
        without waiting for any of them (on a GPU each wait leaves it idle)."""
        self.cache.crop(self.committed)
        logits, hidden = self._step(aux, next_tokens, self.committed, True)
        self.committed += next_tokens.numel()
        tokens = []
        for j in range(k):
            tok = self.draft_to_target[logits.argmax()]
            tokens.append(tok)
            if j + 1 < k:
                logits, hidden = self._step(hidden, tok.view(1), self.committed + j, False)
        return torch.stack(tokens)

    @torch.inference_mode()
    def propose(
        self, aux: torch.Tensor, next_tokens: list[int], k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Commit the new target positions (``aux`` [n, A*H], ``next_tokens`` = x[i+1] for each),
        then draft k tokens. Returns (draft tokens in target ids, draft probs [k, V] or None)."""
        self.cache.crop(self.committed)
        logits, hidden = self._step(aux, next_tokens, self.committed, True)
        self.committed += len(next_tokens)
        tokens, probs = [], []
        pos = self.committed  # position of the first TTT step
        for j in range(k):
            if temperature <= 0:
                d = int(logits.argmax())
            else:
                q = probs_at(logits, temperature)
                probs.append(self.to_target_probs(logits, temperature))
                d = int(torch.multinomial(q, 1, generator=generator))
            tok = int(self.draft_to_target[d])
            tokens.append(tok)
            if j + 1 < k:
                logits, hidden = self._step(hidden, [tok], pos + j, False)
        return tokens, (torch.stack(probs) if probs else None)


@torch.inference_mode()
def speculative_generate(
    target: TargetRunner,
    draft: DraftRunner,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    k: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Chain speculative decoding of ``prompt``; greedy when ``temperature`` <= 0."""
    if target.capture is None:
        raise ValueError("speculative decoding needs a TargetRunner built with aux_layers")
    start = time.perf_counter()
    target.reset()
    draft.reset()
    logits, aux = target.forward(prompt)
    out = [_pick(logits[-1], temperature, generator)]
    res = GenerationResult(tokens=out, seconds=0.0, accepted_per_pos=[0] * k)
    # Positions whose target features the draft has not consumed yet, and the token after each.
    new_aux, new_next = aux, prompt[1:] + [out[-1]]
    dev = logits.device
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        base = target.length
        if temperature <= 0:  # one wait for the device per round: the verification's verdict
            next_ids = torch.tensor(new_next, dtype=torch.long, device=dev)
            drafts_t = draft.propose_greedy(new_aux, next_ids, k)
            logits, aux = target.forward(torch.cat([next_ids[-1:], drafts_t]))
            n, nxt = verify_greedy(logits, drafts_t)
            drafts = drafts_t[:n].tolist()
        else:
            drafts, q = draft.propose(new_aux, new_next, k, temperature, generator)
            logits, aux = target.forward([out[-1]] + drafts)
            n, nxt = verify_sampling(probs_at(logits, temperature), q, torch.tensor(drafts, device=dev), generator)
        res.rounds += 1
        res.draft_tokens += k
        for j in range(n):
            res.accepted_per_pos[j] += 1
        target.crop(base + n + 1)
        emitted = drafts[:n] + [nxt]
        new_aux, new_next = aux[: n + 1], emitted
        for t in emitted:  # stop exactly where plain decoding would
            if len(out) >= max_new_tokens or out[-1] in stop_ids:
                break
            out.append(t)
    res.seconds = time.perf_counter() - start
    return res


def steps_record(
    token_ids: list[int], steps: list[int], max_new_tokens: int, stop_ids: set[int], k: int
) -> dict[str, Any]:
    """The record of :func:`speculative_generate` from a run read as tokens gained per round (vLLM's
    engine steps, or the replay engine's walk): ``token_ids`` generated without stopping, ``steps``
    the tokens gained at each step (the prefill's one token, then 1 + the drafts accepted in each
    round). A round counts while the answer is shorter than ``max_new_tokens`` and has not stopped,
    and counts whole, as the loop counts it; the answer is cut at the first stop token or
    ``max_new_tokens``."""
    out: list[int] = []
    rounds, per_pos, pos = 0, [0] * k, 0
    for i, n in enumerate(steps):
        if i > 0:
            if len(out) >= max_new_tokens or out[-1] in stop_ids:
                break
            rounds += 1
            for j in range(min(n - 1, k)):
                per_pos[j] += 1
        for t in token_ids[pos : pos + n]:
            if out and (len(out) >= max_new_tokens or out[-1] in stop_ids):
                break
            out.append(t)
        pos += n
    return {"tokens": out, "rounds": rounds, "draft_tokens": k * rounds, "accepted_per_pos": per_pos}


class BuiltinEngine:
    """The `builtin` engine: speculative generation plus, for the speedup, plain generation of
    the same prompt with the same target in the same process."""

    def __init__(self, model, draft, k: int, temperature: float = 0.0, seed: int = 0, compare_plain: bool = True):
        self.target = TargetRunner(model, list(draft.config.aux_layer_ids))
        self.draft = DraftRunner(draft)
        self.k, self.temperature, self.compare_plain = k, temperature, compare_plain
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        # Warm up both paths once so the first prompt's timing is not the allocator's.
        speculative_generate(self.target, self.draft, [0, 1, 2, 3], 4, set(), k, temperature, self.generator)
        plain_generate(self.target, [0, 1, 2, 3], 4, set(), temperature, self.generator)

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> dict:
        spec = speculative_generate(
            self.target, self.draft, prompt, max_new_tokens, stop_ids, self.k, self.temperature, self.generator
        )
        out = {
            "tokens": spec.tokens,
            "rounds": spec.rounds,
            "draft_tokens": spec.draft_tokens,
            "accepted_per_pos": spec.accepted_per_pos,
            "seconds": spec.seconds,
        }
        if self.compare_plain:
            plain = plain_generate(self.target, prompt, max_new_tokens, stop_ids, self.temperature, self.generator)
            out.update(
                plain_tokens=len(plain.tokens),
                plain_seconds=plain.seconds,
                matches_plain=(plain.tokens == spec.tokens) if self.temperature <= 0 else None,
            )
        return out

    def close(self) -> None:
        self.target.close()
