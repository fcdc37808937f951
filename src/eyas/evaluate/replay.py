"""The `replay` engine: greedy acceptance for every k from one pass over the target's own answers.

Under greedy verification the output does not depend on the draft: it is the target's greedy
answer. So the chain of draft tokens the builtin loop proposes at a round is fixed by the answer's
prefix alone, and so is how many of them the target accepts. The round that starts after the
answer's token x[c] (its features committed up to position c-1) drafts, step j, the token at
position c+1+j from the target's features up to c-1 and the draft's own chain; that is the
training-time-test unroll's step j at index c-1 (:meth:`eyas.draft.model.Eagle3Draft.forward`,
whose alignment mirrors :meth:`~eyas.draft.model.Eagle3Draft.step`), with the answer's tokens as
the chain's inputs, which are the draft's own tokens as long as the chain is accepted.

The engine therefore:
1. decodes each turn greedily with the HF target, many turns at once, ``max_new_tokens`` plus a
   tail past the cut and any stop token (at least k + 1 tokens: what the loop's last round verifies);
   these answers are the same for every draft and every k, and are kept (``references.jsonl``);
2. runs the target once over each prompt + answer for its aux states, and the draft's unroll of
   ``max(k)`` steps over them: the accepted chain length at every position of the answer. Each
   turn's chain lengths go to ``chains.jsonl`` as they are made, so an evaluation that stopped
   goes on from the questions it finished, and one run again with the same draft and answers
   makes none (:func:`chains`);
3. walks the rounds as the loop does (a round of k drafts accepts the chain's length capped at k,
   and emits it plus one token) and cuts the answer where the loop stops
   (:func:`eyas.evaluate.speculative.steps_record`).

In exact arithmetic this is the builtin loop's record, token for token and round for round; in
floating point the batched forwards round differently from the loop's incremental ones, so a
near-tie can go the other way (the tests check equality in float32). It gives acceptance only:
there is no speculative loop to time, so no speedup.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from eyas.cache import cache_dir
from eyas.errors import EyasError
from eyas.evaluate.kv_cache import cache_kwargs
from eyas.evaluate.prompts import Question, render_turn
from eyas.evaluate.speculative import steps_record
from eyas.fsio import atomic_write_text

REFERENCES = "references.jsonl"
CHAINS = "chains.jsonl"
# Tokens decoded past each answer's end: the loop's last round verifies up to k of them, so a tail
# of 8 serves every k up to 7 from one set of answers.
MIN_TAIL = 8


def tail_for(ks: list[int]) -> int:
    """The tail the answers need for every k of ``ks``."""
    return max(MIN_TAIL, max(ks) + 1)


def chain_lengths(correct: torch.Tensor) -> torch.Tensor:
    """``correct`` [K, N] (draft step j right at anchor n) -> [N]: how many leading steps are right."""
    return correct.to(torch.long).cumprod(dim=0).sum(dim=0)


@torch.no_grad()
def chain_matches(
    out: list[torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    draft_to_target: torch.Tensor,
    lm_head_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T]: at each position i, how many leading TTT steps j predict the answer's token x[i+2+j]
    (in the loss mask, same document). ``out`` per step: draft logits [B, T, V], or with
    ``lm_head_weight`` the normed hidden it takes (the fused loss's forward). Used by this engine and
    by `eyas train`'s replay of its held-out answers."""
    from eyas.draft.loss import step_valid

    b, t = input_ids.shape
    correct = torch.zeros(len(out), b, t, dtype=torch.bool, device=input_ids.device)
    for j, o in enumerate(out):
        valid = step_valid(loss_mask, doc_ids, j)
        if valid is None:
            continue
        n = valid.shape[1]
        for r in range(b):  # a row at a time: one [T, draft_vocab] of logits at most
            z = o[r, :n] if lm_head_weight is None else o[r, :n].to(lm_head_weight.dtype) @ lm_head_weight.T
            correct[j, r, :n] = (draft_to_target[z.argmax(-1)] == input_ids[r, 2 + j :]) & valid[r]
    return chain_lengths(correct)


def walk(lengths: list[int], k: int, n_tokens: int) -> list[int]:
    """The tokens gained per step of a chain speculative loop with ``k`` drafts per round over an
    answer of ``n_tokens`` known tokens: the prefill's 1, then 1 + the accepted drafts per round.
    ``lengths[e - 1]`` is the chain accepted after the answer's first ``e`` tokens."""
    steps, emitted = [1], 1
    while emitted < n_tokens:
        gained = 1 + min(k, lengths[emitted - 1])
        steps.append(gained)
        emitted += gained
    return steps


def greedy_answers(model, prompts: list[list[int]], n_new: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations of ``prompts``, ``n_new`` tokens each, decoded ``batch_size`` rows at a
    time (left-padded, positions counted from each row's first token, no stop tokens)."""
    from transformers import DynamicCache

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    dev = model.device
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long, device=dev)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p, device=dev)
            mask[r, width - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=model.config)
        tokens = []
        with torch.inference_mode():
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True
            ).logits[:, -1]
            for _ in range(n_new):
                nxt = logits.argmax(-1)
                tokens.append(nxt)
                if len(tokens) == n_new:
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = pos[:, -1:] + 1
                logits = model(
                    input_ids=nxt[:, None],
                    attention_mask=mask,
                    position_ids=pos,
                    **cache_kwargs(model, cache),
                    use_cache=True,
                ).logits[:, -1]
        gen = torch.stack(tokens, dim=1).tolist()
        for r, i in enumerate(rows):
            out[i] = gen[r]
    return out


def cut(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The answer as the loop ends it: at the first stop token (kept) or ``max_new_tokens``."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


class ReferencePool:
    """``pool(questions)`` for :func:`eyas.evaluate.runner.run_questions`: the target's greedy answers
    to every turn, ``batch_size`` questions decoded together, each turn with its ``tail`` tokens past
    the cut. A question's records carry ``prompt_ids`` and ``uncut_ids`` (the answer and its tail)."""

    def __init__(self, model, tokenizer, max_new_tokens: int, stop_ids: set[int], tail: int, batch_size: int):
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, stop_ids
        self.max_new_tokens, self.tail, self.batch_size = max_new_tokens, tail, batch_size

    def __call__(self, questions: list[Question]) -> Iterator[list[dict[str, Any]]]:
        from eyas.evaluate.runner import turn_record

        for start in range(0, len(questions), self.batch_size):
            chunk = questions[start : start + self.batch_size]
            answers: list[list[str]] = [[] for _ in chunk]
            records: list[list[dict[str, Any]]] = [[] for _ in chunk]
            for turn in range(max(len(q.turns) for q in chunk)):
                live = [i for i, q in enumerate(chunk) if turn < len(q.turns)]
                prompts = [render_turn(self.tokenizer, chunk[i], turn, answers[i]) for i in live]
                uncut = self._uncut(prompts)
                for i, prompt, full in zip(live, prompts, uncut):
                    out = {
                        "tokens": cut(full, self.max_new_tokens, self.stop_ids),
                        "prompt_ids": prompt,
                        "uncut_ids": full,
                        "rounds": 0,
                        "accepted_per_pos": [],
                    }
                    rec, text = turn_record(chunk[i], turn, prompt, out, self.tokenizer, self.stop_ids)
                    records[i].append(rec)
                    answers[i].append(text)
            yield from records

    def _uncut(self, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt's answer and tail: decoded to ``max_new_tokens + tail`` at first, then, for a
        row that stopped early, shortened to its stop token plus the tail."""
        full = greedy_answers(self.model, prompts, self.max_new_tokens + self.tail, self.batch_size)
        return [f[: len(cut(f, self.max_new_tokens, self.stop_ids)) + self.tail] for f in full]


class ReplayScorer:
    """The accepted chain length at every position of a turn's answer, for one draft."""

    def __init__(self, model, draft):
        from eyas.features.capture import HiddenStateCapture

        self.capture = HiddenStateCapture(model, list(draft.config.aux_layer_ids))
        self.draft = draft.eval()
        self.device = model.device
        self.dtype = draft.fc.weight.dtype
        self.draft_to_target = draft.target_ids()

    @torch.inference_mode()
    def lengths(self, prompt: list[int], uncut: list[int], steps: int) -> list[int]:
        """Entry e - 1: the draft tokens of a ``steps``-long chain the target accepts in the round
        after the answer's first e tokens (only what ``uncut`` can confirm: it shortens near its end)."""
        x = torch.tensor([prompt + uncut], dtype=torch.long, device=self.device)
        t, first = x.shape[1], len(prompt) - 1  # anchor of the first round: the prompt's last position
        aux, _ = self.capture.capture(x)
        aux = aux.reshape(1, t, -1).to(self.dtype)
        pos, doc = torch.arange(t, device=self.device)[None], torch.zeros_like(x)
        normed = self.draft(aux, x, pos, doc, steps, attention="dense", return_normed=True)
        answer = torch.arange(t, device=self.device)[None] > first  # the tokens a chain is checked against
        chains = chain_matches(normed, x, answer, doc, self.draft_to_target, self.draft.lm_head.weight)
        return chains[0, first : t - 1].tolist()

    def close(self) -> None:
        self.capture.remove()


def replay_record(
    ref: dict[str, Any], lengths: list[int], k: int, max_new_tokens: int, stop_ids: set[int]
) -> dict[str, Any]:
    """Turn ``ref``'s record with ``k`` drafts per round, from the chain ``lengths`` of its answer."""
    uncut = ref["uncut_ids"]
    got = steps_record(uncut, walk(lengths, k, len(uncut)), max_new_tokens, stop_ids, k)
    if got["tokens"] != ref["output_ids"]:
        raise EyasError(
            f"replay of question {ref['question_id']} turn {ref['turn']}: the walk cut the "
            "answer elsewhere than the reference; the references file is damaged: delete it"
        )
    rounds = got["rounds"]
    return {
        "question_id": ref["question_id"],
        "category": ref["category"],
        "turn": ref["turn"],
        "prompt_tokens": ref["prompt_tokens"],
        "new_tokens": len(got["tokens"]),
        "output_ids": got["tokens"],
        "rounds": rounds,
        "draft_tokens": got["draft_tokens"],
        "accepted_per_pos": got["accepted_per_pos"],
        "tau": 1 + sum(got["accepted_per_pos"]) / rounds if rounds else None,
    }


def chain_record(scorer: ReplayScorer, ref: dict[str, Any], steps: int) -> dict[str, Any]:
    """``ref``'s turn with its chain lengths from a ``steps``-long unroll (:meth:`ReplayScorer.lengths`)."""
    lengths = scorer.lengths(ref["prompt_ids"], ref["uncut_ids"], steps)
    return {"question_id": ref["question_id"], "turn": ref["turn"], "lengths": lengths}


def records_by_k(
    references: list[dict[str, Any]],
    chains: list[dict[str, Any]],
    ks: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
) -> dict[int, list[dict[str, Any]]]:
    """Per k of ``ks``: every reference turn's record, walked from its chain lengths."""
    lengths = {(c["question_id"], c["turn"]): c["lengths"] for c in chains}
    return {
        k: [
            replay_record(ref, lengths[(ref["question_id"], ref["turn"])], k, max_new_tokens, stop_ids)
            for ref in references
        ]
        for k in ks
    }


def replay(
    model,
    draft,
    references: list[dict[str, Any]],
    ks: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    progress: bool = True,
) -> dict[int, list[dict[str, Any]]]:
    """Per k of ``ks``: the records of every reference turn, from one unroll of ``max(ks)`` steps."""
    from tqdm import tqdm

    scorer = ReplayScorer(model, draft)
    try:
        made = [
            chain_record(scorer, ref, max(ks))
            for ref in tqdm(references, desc="replay", unit="turn", disable=not progress)
        ]
    finally:
        scorer.close()
    return records_by_k(references, made, ks, max_new_tokens, stop_ids)


def chains(
    model,
    draft,
    questions: list[Question],
    references: list[dict[str, Any]],
    steps: int,
    path: Path,
    draft_sha256: str,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Every reference turn's chain lengths, kept in ``path`` question by question: read back where
    the file holds them for this draft (its sha256), these answers and ``steps``, the rest made and
    added. A file of another draft or other answers is a cache of something else: it starts over."""
    from eyas.evaluate.runner import run_questions

    # the answers as the chains saw them: a references file decoded again (another GPU, say) may
    # differ, and its chains with it
    answers = hashlib.sha256(
        json.dumps([[r["question_id"], r["turn"], r["prompt_ids"], r["uncut_ids"]] for r in references]).encode()
    ).hexdigest()
    settings = {"engine": "replay chains", "draft_sha256": draft_sha256, "answers_sha256": answers, "steps": steps}
    by_q: dict[str, list[dict[str, Any]]] = {}
    for ref in references:
        by_q.setdefault(ref["question_id"], []).append(ref)
    scorer = ReplayScorer(model, draft)

    def pool(todo: list[Question]) -> Iterator[list[dict[str, Any]]]:
        for q in todo:
            yield [chain_record(scorer, ref, steps) for ref in by_q[q.question_id]]

    try:
        return run_questions(None, questions, None, 0, set(), path, settings, progress, pool=pool, restart=True)
    finally:
        scorer.close()


def reference_settings(
    target_id: str,
    max_new_tokens: int,
    dtype: str,
    prompts: str,
    device: str,
    ks: list[int],
    prompts_sha256: str | None = None,
) -> dict[str, Any]:
    """What the target's answers depend on (not the draft, nor k beyond the tail they carry): the
    header of a references file, which is reused only where it matches. The prompts by content
    where ``prompts_sha256`` is given, so a file serves the same prompts at any path, on any machine."""
    out = {
        "target_id": target_id,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "prompts": prompts if prompts_sha256 is None else f"sha256:{prompts_sha256}",
        "device": device.split(":")[0],
    }
    return {**out, "engine": "replay references", "tail": tail_for(ks)}


def _by_content(settings: dict[str, Any]) -> dict[str, Any]:
    """A references header as written before the prompts were keyed by content (their path beside
    ``prompts_sha256``), as it is written now."""
    if "prompts_sha256" not in settings:
        return settings
    out = {k: v for k, v in settings.items() if k != "prompts_sha256"}
    return {**out, "prompts": f"sha256:{settings['prompts_sha256']}"}


def shared_references(settings: dict[str, Any]) -> Path:
    """Where eyas's cache keeps the target's answers under ``settings`` (a references header):
    tau while training and every evaluation of the same prompts on the same target read and extend
    this one file, so a pipeline decodes them once, and a copy of the cache serves another machine."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "replay" / f"{key}.jsonl"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """``path``'s writers take turns (one writes, the others wait and then read)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _lines(path: Path) -> int:
    with open(path) as fh:
        return sum(1 for _ in fh)


def target_references(
    model,
    tokenizer,
    questions: list[Question],
    stop_ids: set[int],
    max_new_tokens: int,
    path: Path,
    settings: dict[str, Any],
    batch_size: int,
    progress: bool,
) -> list[dict[str, Any]]:
    """The target's greedy answers to every turn of ``questions``: read from ``path`` where it has
    them, the rest decoded and added. A ``path`` other than the cache's (an evaluation's own
    references) starts from the cache's answers where it has none, and gives the cache its own
    where they are more."""
    from eyas.evaluate.runner import adopt_settings, run_questions, settings_of

    def same(old: dict[str, Any]) -> bool:
        return _by_content(old) == settings

    pool = ReferencePool(model, tokenizer, max_new_tokens, stop_ids, settings["tail"], batch_size)
    shared = shared_references(settings)
    own = path.resolve() != shared.resolve()
    with _locked(path):
        if own and not path.is_file():
            with _locked(shared):
                if shared.is_file():
                    adopt_settings(shared, settings, same)
                    if settings_of(shared) == settings:
                        atomic_write_text(path, shared.read_text())
        adopt_settings(path, settings, same)
        records = run_questions(
            None, questions, tokenizer, max_new_tokens, stop_ids, path, settings, progress, pool=pool
        )
        if own:
            with _locked(shared):
                if not shared.is_file() or settings_of(shared) != settings or _lines(shared) < _lines(path):
                    atomic_write_text(shared, path.read_text())
    return records


def references_path(out: Path) -> Path:
    return Path(out) / "replay" / REFERENCES
