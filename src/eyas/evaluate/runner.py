"""Run an engine over an MT-bench prompt set, turn by turn, and collect per-prompt records.

Turn t's prompt holds the model's own answers to turns < t. Records are appended to a JSONL file
as each question finishes, so an interrupted evaluation resumes where it stopped (a header line
records the settings; a file written with other settings is refused, never mixed).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from tqdm import tqdm

from eyas.errors import EyasError
from eyas.evaluate.prompts import Question, render_turn


class Engine(Protocol):
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> dict[str, Any]:
        """Returns at least ``tokens``, ``rounds``, ``accepted_per_pos``, ``seconds``."""


def turn_record(
    q: Question, turn: int, prompt: list[int], out: dict[str, Any], tokenizer, stop_ids: set[int]
) -> tuple[dict[str, Any], str]:
    """Turn ``turn``'s record from an engine's answer ``out``, and the answer's text (the next
    turn's prompt holds it)."""
    tokens = out["tokens"]
    rec = {
        "question_id": q.question_id,
        "category": q.category,
        "turn": turn,
        "prompt_tokens": len(prompt),
        "new_tokens": len(tokens),
        "output_ids": tokens,
        **{k: v for k, v in out.items() if k != "tokens"},
    }
    rounds = rec["rounds"]
    rec["tau"] = 1 + sum(rec["accepted_per_pos"]) / rounds if rounds else None
    return rec, tokenizer.decode([t for t in tokens if t not in stop_ids], skip_special_tokens=True)


def answer_question(
    engine: Engine, q: Question, tokenizer, max_new_tokens: int, stop_ids: set[int]
) -> list[dict[str, Any]]:
    """Every turn of ``q``, each prompt holding the engine's own earlier answers: one record per turn."""
    answers: list[str] = []
    q_records = []
    for turn in range(len(q.turns)):
        prompt = render_turn(tokenizer, q, turn, answers)
        rec, answer = turn_record(
            q, turn, prompt, engine.generate(prompt, max_new_tokens, stop_ids), tokenizer, stop_ids
        )
        answers.append(answer)
        q_records.append(rec)
    return q_records


def run_questions(
    engine: Engine | None,
    questions: list[Question],
    tokenizer,
    max_new_tokens: int,
    stop_ids: set[int],
    records_path: Path,
    settings: dict[str, Any],
    progress: bool = True,
    pool: Callable[[list[Question]], Iterable[list[dict]]] | None = None,
    restart: bool = False,
) -> list[dict]:
    """Answer the questions not yet in ``records_path``; return all records in question order.

    ``pool``: instead of ``engine``, a function that answers a list of questions in any order,
    yielding each question's records as it finishes (worker processes). ``restart``: a file made
    with other settings (or whose header is torn) is a cache of something else and starts over,
    where by default it is refused."""
    records, todo = _resume(questions, records_path, settings, restart)
    answered = (
        pool(todo)
        if pool is not None
        else (answer_question(engine, q, tokenizer, max_new_tokens, stop_ids) for q in todo)
    )
    with (
        open(records_path, "a") as fh,
        tqdm(
            total=len(questions),
            initial=len(questions) - len(todo),
            desc=f"evaluate ({settings['engine']})",
            unit="q",
            disable=not progress,
        ) as bar,
    ):
        for q_records in answered:
            for rec in q_records:
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            records.extend(q_records)
            bar.update(1)
    order = {q.question_id: i for i, q in enumerate(questions)}
    return sorted([r for r in records if r["question_id"] in order], key=lambda r: (order[r["question_id"]], r["turn"]))


def unanswered(questions: list[Question], records_path: Path, settings: dict[str, Any]) -> list[Question]:
    """The questions that ``run_questions`` would still answer (those without all their turns)."""
    return _resume(questions, records_path, settings)[1]


def _resume(
    questions: list[Question], records_path: Path, settings: dict[str, Any], restart: bool = False
) -> tuple[list[dict], list[Question]]:
    """The whole questions' records in ``records_path``, and the questions still to answer."""
    records, torn = _load_records(records_path, settings, restart)
    # A question counts as done with all its turns; a kill while its turns were being written can
    # leave the first ones alone (and a torn last line), which are dropped here to be redone. The
    # file is rewritten without them, so what is appended next is not hidden behind a tear.
    n_turns = {q.question_id: len(q.turns) for q in questions}
    have = Counter(r["question_id"] for r in records)
    done_ids = {qid for qid, n in have.items() if n >= n_turns.get(qid, 0)}
    if torn or len(done_ids) < len(have):
        records = [r for r in records if r["question_id"] in done_ids]
        _rewrite(records_path, settings, records)
    return records, [q for q in questions if q.question_id not in done_ids]


def _load_records(path: Path, settings: dict[str, Any], restart: bool = False) -> tuple[list[dict], bool]:
    """The whole records of ``path``, and whether a torn last line followed them."""
    if not path.is_file() or (restart and settings_of(path) != settings):
        path.parent.mkdir(parents=True, exist_ok=True)
        _rewrite(path, settings, [])
        return [], False
    lines = path.read_text().splitlines()
    header = json.loads(lines[0]) if lines else {}
    if header.get("settings") != settings:
        diff = sorted(
            k
            for k in set(settings) | set(header.get("settings", {}))
            if settings.get(k) != header.get("settings", {}).get(k)
        )
        raise EyasError(
            f"{path}: results of an evaluation with other settings or inputs ({', '.join(diff)} "
            "differ); use another --out, or delete the file to start over"
        )
    out = []
    for line in lines[1:]:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            return out, True  # a torn last line from a kill: everything before it is whole
    return out, False


def adopt_settings(path: Path, settings: dict[str, Any], same: Callable[[dict[str, Any]], bool]) -> bool:
    """Give ``path``'s records the header ``settings`` where its own settings differ but ``same``
    says they describe the same inputs (how settings are written changed, not what was run)."""
    old = settings_of(path) if path.is_file() else None
    if old is None or old == settings or not same(old):
        return False
    records, _ = _load_records(path, old)
    _rewrite(path, settings, records)
    return True


def settings_of(path: Path) -> Any:
    """The settings in ``path``'s header; None where it has none (empty, torn, not a header)."""
    with open(path) as fh:
        first = fh.readline()
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        return None
    return header.get("settings") if isinstance(header, dict) else None


def _rewrite(path: Path, settings: dict[str, Any], records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"settings": settings}) + "\n")
        for r in records:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
