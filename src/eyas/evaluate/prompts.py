"""MT-bench style prompt sets: reading ``question.jsonl`` and rendering multi-turn conversations.

Each line is ``{"question_id", "category", "turns": [str, ...]}``. Turn t is rendered with the
target's chat template after the user turns 0..t-1 *and the model's own answers to them*, so
the second turn follows what the model actually said (as in MT-bench).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

# The committed copy of MT-bench (Apache-2.0, see data/mt_bench/SOURCE.md).
DEFAULT_PROMPTS = Path(__file__).resolve().parents[3] / "data" / "mt_bench" / "question.jsonl"


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


def read_questions(
    path: str | Path, max_prompts: int | None = None, max_per_category: int | None = None
) -> list[Question]:
    """Read a question.jsonl file; every malformed line is reported with its line number.

    ``max_per_category`` keeps the first N questions of each category (MT-bench is sorted by
    category, so a plain ``max_prompts`` would see only the first one or two)."""
    path = Path(path)
    if not path.is_file():
        raise EyasError(
            f"prompts {path}: no such file; pass an MT-bench style question.jsonl (default: {DEFAULT_PROMPTS})"
        )
    out: list[Question] = []
    seen: set[str] = set()
    with open(path, "rb") as fh:
        offset = 0
        for lineno, raw in enumerate(fh, 1):
            where = f"prompts {path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise EyasError(
                    f"{where}: byte 0x{raw[e.start]:02x} at byte {offset + e.start:,} of the "
                    f"file is not valid UTF-8 ({e.reason}); save the file as UTF-8"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EyasError(f"{where}: not valid JSON ({e}); each line must be one JSON object") from e
            q = _parse(obj, where)
            if max_per_category is not None and sum(x.category == q.category for x in out) >= max_per_category:
                continue
            out.append(q)
            if out[-1].question_id in seen:
                raise EyasError(
                    f"{where}: question_id {out[-1].question_id!r} appears twice; "
                    "ids must be unique so per-prompt results can be told apart"
                )
            seen.add(out[-1].question_id)
            if max_prompts is not None and len(out) >= max_prompts:
                break
    if not out:
        raise EyasError(f"prompts {path}: no questions found; the file is empty")
    return out


def categories_in_turn(questions: list[Question]) -> list[Question]:
    """The questions with their categories taken in turn (the first of each, then the second of
    each, ...), each category's own order kept: any first N of them span every category, where
    MT-bench's file order (sorted by category) would give its first categories only."""
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    lists = list(by_cat.values())
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def _parse(obj: Any, where: str) -> Question:
    if not isinstance(obj, dict):
        raise EyasError(f"{where}: expected a JSON object with 'turns', got {type(obj).__name__}")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise EyasError(
            f"{where}: 'turns' must be a non-empty list of non-empty strings "
            f'(MT-bench format: {{"question_id", "category", "turns": [...]}})'
        )
    qid = obj.get("question_id", where.rsplit(":", 1)[-1])
    return Question(question_id=str(qid), category=str(obj.get("category") or "uncategorized"), turns=tuple(turns))


def render_turn(tokenizer, question: Question, turn: int, answers: list[str]) -> list[int]:
    """Token ids of the prompt for ``turn``: user turns and the model's previous ``answers``.

    Rendered to text with the chat template, then tokenized without extra special tokens, so the
    ids are exactly what the template says (the same ids are sent to every engine).
    """
    if len(answers) != turn:
        raise ValueError(f"turn {turn} needs {turn} previous answers, got {len(answers)}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise EyasError(
            "the target's tokenizer has no chat template; evaluation renders prompts "
            "with it. Use an instruct/chat target or add a chat_template to its tokenizer"
        )
    messages: list[dict[str, str]] = []
    for t in range(turn):
        messages.append({"role": "user", "content": question.turns[t]})
        messages.append({"role": "assistant", "content": answers[t]})
    messages.append({"role": "user", "content": question.turns[turn]})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
