"""Self-distillation (`eyas prepare --regenerate`): replace assistant turns with the target's answers.

Turn by turn: the r-th assistant turn of every conversation is answered conditioned on the
conversation so far with the *regenerated* earlier answers: a conversation's next turn is asked as
soon as its previous answer is back. HF ``generate`` runs left-padded batches, earlier turns
first; vLLM (``regenerate_vllm.py``; ``auto`` takes it where it is installed) keeps one or more
engines full. Every answer is appended (and
flushed) to ``regenerated.jsonl`` in the output directory, keyed by conversation id and turn, so a
re-run skips what is done. ``regenerate.json`` records the target and sampling settings; a re-run
with other settings is refused rather than mixing answers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eyas.data.formats import Skip
from eyas.device import resolve_device
from eyas.errors import EyasError

CACHE = "regenerated.jsonl"
HEADER = "regenerate.json"
CONVERSATIONS = "regenerated_conversations.jsonl"  # the result as chat messages, reusable as --data


def _recorded(out: Path) -> dict[str, Any] | None:
    """The settings recorded beside the answers already in ``out`` (None: no answers yet)."""
    head = out / HEADER
    return json.loads(head.read_text()) if head.is_file() else None


def _load_cache(
    out: Path, header: dict[str, Any], found: dict[str, Any] | None
) -> dict[str, dict[int, dict[str, Any]]]:
    """Answers already made: {conversation id: {turn: record}}, refused where ``found`` (their
    recorded settings) differ from ``header``. Drops a torn last line."""
    if found is not None:
        diffs = [f"{k}: {found.get(k)!r} there, {header[k]!r} now" for k in header if found.get(k) != header[k]]
        if diffs:
            raise EyasError(
                f"{out / CACHE} holds answers made with other settings ({'; '.join(diffs)}); "
                "re-run with the same settings, or choose a new --out"
            )
    else:
        from eyas.manifest import write_manifest

        write_manifest(out, header, name=HEADER)
    cache: dict[str, dict[int, dict[str, Any]]] = {}
    path = out / CACHE
    if not path.is_file():
        return cache
    raw = path.read_bytes()
    good_end = 0
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # torn write at the end: cut it off below
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise EyasError(
                f"{path}: corrupt line at byte {good_end} ({e}); delete the file to regenerate from scratch"
            ) from e
        cache.setdefault(rec["id"], {})[int(rec["turn"])] = rec
        good_end += len(line)
    if good_end != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
    return cache


def regenerate(
    target, tok, encoder, items: list[tuple[str, str, Any]], out: Path, opts, max_length: int, progress: bool = True
) -> tuple[list[tuple[str, str, Any]], dict[str, Any]]:
    """Return ``items`` with assistant turns replaced by the target's answers, plus counts."""
    import time

    from tqdm import tqdm

    found = _recorded(Path(out))
    engine = _pick_engine(opts, found.get("engine") if found else None)
    header = {
        "target": target.identity,
        "chat_template_sha256": encoder.template_sha256,
        "max_length": max_length,
        **opts.settings(),
        "engine": engine,
    }
    cache = _load_cache(Path(out), header, found)
    convs = {i: it[2] for i, it in enumerate(items) if not isinstance(it[2], Skip)}
    turns = {i: [j for j, m in enumerate(msgs) if m["role"] == "assistant"] for i, msgs in convs.items()}
    if opts.max_turns:  # later turns are cut off with their conversation's tail (counted below)
        turns = {i: t[: opts.max_turns] for i, t in turns.items()}
    answers: dict[int, list[dict[str, Any]]] = {i: [] for i in convs}
    ended: dict[int, str] = {}  # conversation -> why it stops being regenerated
    stops = [int(x) for x in encoder.stop_ids]
    if not stops:
        raise EyasError(
            f"target {target.spec}: no eos token in the tokenizer or generation_config."
            "json, so eyas cannot tell where an answer ends; add eos_token_id to "
            "generation_config.json"
        )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    device = resolve_device(opts.device) if engine == "hf" else "vllm"

    def next_item(i: int):
        """Conversation i's next prompt past its cached answers: ((i, turn), ids, seed), or None."""
        sid = items[i][0]
        while i not in ended and len(answers[i]) < len(turns[i]):
            r = len(answers[i])
            rec = cache.get(sid, {}).get(r)
            if rec is None:
                prompt = _with_answers(convs[i][: turns[i][r]], turns[i], answers[i])
                ids = tok(encoder.render(prompt, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                if len(ids) >= max_length:
                    ended[i] = "beyond_max_length"  # later turns would be cut off anyway
                    return None
                # a seed per answer, by conversation and turn: not tied to the engines' batching
                return (i, r), ids, opts.seed * 1_000_003 + r * 10_007 + i
            answers[i].append(rec)
            if rec["finish"] == "empty":
                ended[i] = "empty"
        return None

    todo = [it for i in convs if (it := next_item(i)) is not None]
    bar = tqdm(
        total=sum(max(0, len(t) - len(cache.get(items[i][0], {}))) for i, t in turns.items()),
        unit="answer",
        desc="regenerate",
        disable=not progress,
        dynamic_ncols=True,
    )
    fh = open(Path(out) / CACHE, "a", encoding="utf-8")
    synced = [time.monotonic()]

    def on_answer(key: tuple[int, int], text: str, finish: str, prompt_tokens: int) -> list:
        i, r = key
        rec = {"id": items[i][0], "turn": r, "text": text, "finish": finish, "prompt_tokens": prompt_tokens}
        fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        fh.flush()  # a killed run keeps every answer it returned
        if time.monotonic() - synced[0] > 5:
            os.fsync(fh.fileno())
            synced[0] = time.monotonic()
        answers[i].append(rec)
        if finish == "empty":
            ended[i] = "empty"
        bar.update(1)
        nxt = next_item(i)  # its next turn is asked at once, behind the prompts already queued
        return [nxt] if nxt is not None else []

    gen = None
    try:
        if todo:  # a fully cached run loads no model
            gen = _make_generator(engine, target, tok, opts, stops, pad_id, device, Path(out), max_length)
            gen.run(todo, on_answer)
    finally:
        fh.close()
        bar.close()
        if gen is not None:
            gen.close()

    new_items, counts = _apply_answers(items, convs, turns, answers, opts, Path(out))
    info = {
        "settings": opts.settings(),
        "engine": engine,
        "device": device,
        "batch_size": opts.batch_size,
        "engines": opts.engines if engine == "vllm" else 1,
        "drop_length_limited": opts.drop_length_limited,
        "max_turns": opts.max_turns,
        "cache": CACHE,
        "seeding": gen.seeding if gen is not None else None,  # None: every answer was cached
        "conversations_file": CONVERSATIONS,
        **counts,
    }
    return new_items, info


def _apply_answers(
    items: list[tuple[str, str, Any]],
    convs: dict[int, Any],
    turns: dict[int, list[int]],
    answers: dict[int, list[dict[str, Any]]],
    opts,
    out: Path,
) -> tuple[list[tuple[str, str, Any]], dict[str, int]]:
    """``items`` with each conversation cut after its last regenerated answer (or dropped, counted
    by why), written as chat messages to ``out/CONVERSATIONS``; returns them and the counts."""
    new_items = list(items)
    counts = {
        "answers": 0,
        "length_limited": 0,
        "empty": 0,
        "turns_beyond_max_length": 0,
        "turns_beyond_max_turns": 0,
        "conversations": len(convs),
    }
    for i, msgs in convs.items():
        got = answers[i]
        counts["answers"] += len(got)
        n_limited = sum(a["finish"] == "length" for a in got)
        counts["length_limited"] += n_limited
        counts["turns_beyond_max_length"] += len(turns[i]) - len(got)
        counts["turns_beyond_max_turns"] += sum(m["role"] == "assistant" for m in msgs) - len(turns[i])
        sid, loc, _ = items[i]
        if any(a["finish"] == "empty" for a in got):
            counts["empty"] += 1
            new_items[i] = (sid, loc, Skip("empty_answer", f"turn {len(got) - 1}"))
        elif n_limited and opts.drop_length_limited:
            new_items[i] = (sid, loc, Skip("length_limited_answer", f"{n_limited} answer(s)"))
        elif not got:  # the first prompt is already longer than max_length
            new_items[i] = (sid, loc, Skip("no_trained_tokens", "prompt longer than --max-length"))
        else:
            last = turns[i][len(got) - 1]
            new_items[i] = (sid, loc, _with_answers(msgs[: last + 1], turns[i], got))
    from eyas.fsio import atomic_write_text

    atomic_write_text(
        out / CONVERSATIONS,
        "".join(
            json.dumps({"id": sid, "messages": msgs}, ensure_ascii=False) + "\n"
            for sid, _, msgs in new_items
            if not isinstance(msgs, Skip)
        ),
    )
    return new_items, counts


def _pick_engine(opts, recorded: str | None = None) -> str:
    """``hf`` or ``vllm``; ``auto`` goes on with the engine that made the answers already in --out
    (``recorded``: a finished set then needs no engine where vLLM is missing, and a partial one is
    not finished by another engine), else takes vLLM where eyas can find it (it is much faster)."""
    if opts.backend in ("hf", "vllm"):
        return opts.backend
    if recorded in ("hf", "vllm"):
        return recorded
    from eyas.vllm.find import find_vllm_python

    try:
        find_vllm_python(opts.vllm_python)
    except EyasError:
        return "hf"
    return "vllm"


class _HfGenerator:
    """The HF target's ``generate``, left-padded batches of ``batch_size``: earlier turns first,
    then shorter prompts (less padding)."""

    seeding = "per batch"

    def __init__(self, target, tok, opts, stops: list[int], pad_id: int, device: str):
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(opts.dtype)
        if dtype is None:  # auto
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = target.load_model(dtype=dtype, device=device)
        self.tok, self.opts, self.stops, self.pad_id, self.device = tok, opts, stops, pad_id, device

    def run(self, items: list, on_answer) -> None:
        todo, n = list(items), 0
        while todo:
            todo.sort(key=lambda it: (it[0][1], len(it[1])))
            batch, todo = todo[: self.opts.batch_size], todo[self.opts.batch_size :]
            # one generator per batch: the batch's first answer's seed, offset by the batch count
            texts = _generate(
                self.model,
                self.tok,
                [ids for _, ids, _ in batch],
                self.opts,
                self.stops,
                self.pad_id,
                self.device,
                seed=batch[0][2] + n,
            )
            n += 1
            for (key, ids, _), (text, finish) in zip(batch, texts):
                todo.extend(on_answer(key, text, finish, len(ids)))

    def close(self) -> None:
        pass


class _VllmRun:
    """:class:`VllmGenerator` decoding its answers like the HF backend's."""

    def __init__(self, target, tok, opts, stops: list[int], out: Path, max_length: int):
        import torch

        from eyas.data.regenerate_vllm import VllmGenerator

        self.eng = VllmGenerator(
            target.path,
            out / ".vllm-generate",
            max_model_len=max_length + opts.max_new_tokens,
            seed=opts.seed,
            vllm_python=opts.vllm_python,
            dtype=opts.dtype,
            engines=opts.engines,
            max_num_seqs=opts.max_num_seqs,
            in_flight=opts.batch_size,
            gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        )
        self.tok, self.opts, self.stops = tok, opts, stops
        self.seeding = "per answer" if self.eng.per_request_seed else "engine seed"

    def run(self, items: list, on_answer) -> None:
        lengths = {key: len(ids) for key, ids, _ in items}
        stop_set = set(self.stops)

        def answered(key, token_ids: list[int]) -> list:
            text, finish = _decode(self.tok, token_ids, stop_set)
            nxt = on_answer(key, text, finish, lengths.pop(key))
            lengths.update((k, len(ids)) for k, ids, _ in nxt)
            return nxt

        self.eng.run(items, answered, self.opts.max_new_tokens, self.opts.temperature, self.opts.top_p, self.stops)

    def close(self) -> None:
        self.eng.close()


def _make_generator(
    engine: str, target, tok, opts, stops: list[int], pad_id: int, device: str, out: Path, max_length: int
):
    """The chosen engine: ``run(items, on_answer)`` answers items (key, prompt ids, seed) and the
    follow-ups ``on_answer(key, text, finish, prompt_tokens)`` returns; ``close()``; ``seeding``."""
    if engine == "vllm":
        return _VllmRun(target, tok, opts, stops, out, max_length)
    return _HfGenerator(target, tok, opts, stops, pad_id, device)


def _decode(tok, row: list[int], stop_set: set[int]) -> tuple[str, str]:
    """(text, finish): cut at the first stop token; finish stop|length|empty."""
    end = next((k for k, t in enumerate(row) if t in stop_set), None)
    text = tok.decode(row[:end] if end is not None else row, skip_special_tokens=True).strip()
    if not text:
        return "", "empty"
    return text, "stop" if end is not None else "length"


def _with_answers(msgs: list[dict], turn_idx: list[int], answers: list[dict]) -> list[dict]:
    """``msgs`` with its first len(answers) assistant turns replaced by the regenerated texts."""
    out = [dict(m) for m in msgs]
    for k, a in enumerate(answers):
        if turn_idx[k] < len(out):
            out[turn_idx[k]]["content"] = a["text"]
    return out


def _generate(
    model, tok, prompts: list[list[int]], opts, stops: list[int], pad_id: int, device: str, seed: int
) -> list[tuple[str, str]]:
    """Left-padded batched generation; returns (text, finish) with finish stop|length|empty."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for k, p in enumerate(prompts):
        ids[k, width - len(p) :] = torch.tensor(p)
        mask[k, width - len(p) :] = 1
    sample = opts.temperature > 0
    cfg = GenerationConfig(
        max_new_tokens=opts.max_new_tokens,
        do_sample=sample,
        temperature=opts.temperature if sample else None,
        top_p=opts.top_p if sample else None,
        top_k=None,
        eos_token_id=stops,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
    stop_set = set(stops)
    return [_decode(tok, row, stop_set) for row in gen[:, width:].cpu().tolist()]
