"""`eyas evaluate`'s built-in engine for any draft the comparison produces, on a chosen device.

Same loop, same report as ``eyas evaluate --engine builtin`` (``eyas.evaluate.speculative.
BuiltinEngine`` + ``runner.run_questions`` + ``report.build_report``), for eyas drafts and
converted speculators ones alike (``from_speculators.py`` writes plain eyas checkpoints), and with
what the comparison adds: target and draft on ``--device`` (the CLI evaluates on the CPU), and
questions split into shards. Writes OUT/builtin/report.json (+ records,
plots).

Usage: python evaluate_any.py --draft D --target T --prompts Q --out O -k 3 [--device cuda]
       [--max-prompts N] [--max-new-tokens 256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def evaluate(draft_dir: Path, target_dir: str, prompts: Path, out: Path, k: int, device: str,
             max_prompts: int | None, max_new_tokens: int, dtype: str, progress: bool = True,
             shard: int = 0, num_shards: int = 1, max_per_category: int | None = None) -> dict[str, Any] | None:
    import torch

    from eyas.data.chat import stop_token_ids
    from eyas.draft.model import Eagle3Draft
    from eyas.evaluate.prompts import read_questions
    from eyas.evaluate.report import build_report, write_report
    from eyas.evaluate.runner import run_questions
    from eyas.evaluate.speculative import BuiltinEngine
    from eyas.target import resolve_target

    torch_dtype = getattr(torch, dtype)
    target = resolve_target(target_dir)
    tokenizer = target.load_tokenizer()
    stop_ids = set(stop_token_ids(tokenizer, target.path))
    questions = read_questions(prompts, max_prompts, max_per_category)[shard::num_shards]
    model = target.load_model(dtype=torch_dtype, device=device)
    draft = Eagle3Draft.from_pretrained(draft_dir, device=device, dtype=torch_dtype)
    sub = Path(out) / "builtin"
    sub.mkdir(parents=True, exist_ok=True)
    settings = {"target_id": target.id, "draft": str(Path(draft_dir).resolve()), "k": k,
                "temperature": 0.0, "max_new_tokens": max_new_tokens, "dtype": dtype, "seed": 0,
                "prompts": str(Path(prompts).resolve()), "engine": "builtin", "device": device}
    eng = BuiltinEngine(model, draft, k, 0.0, 0, compare_plain=False)
    try:
        records = run_questions(eng, questions, tokenizer, max_new_tokens, stop_ids,
                                sub / "records.jsonl", settings, progress)
    finally:
        eng.close()
    if num_shards > 1:
        return None  # --merge builds the report from all shards' records
    report = build_report(records, k, _meta(draft_dir, target, draft, prompts, max_new_tokens, dtype, device))
    write_report(sub, report)
    return report


def _meta(draft_dir, target, draft, prompts, max_new_tokens, dtype, device) -> dict[str, Any]:
    return {"engine": "builtin", "target": target.identity, "draft": str(draft_dir),
            "draft_class": type(draft).__name__, "prompts": str(prompts), "temperature": 0.0,
            "max_new_tokens": max_new_tokens, "dtype": dtype, "device": device, "seed": 0}


def merge(out: Path, k: int, meta: dict[str, Any]) -> dict[str, Any]:
    """One report from the records of every ``OUT/shard-*`` (whole questions only)."""
    from eyas.evaluate.report import build_report, write_report

    records = []
    for f in sorted(Path(out).glob("shard-*/builtin/records.jsonl")):
        for line in f.read_text().splitlines()[1:]:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # torn by a kill at the deadline
    report = build_report(records, k, {**meta, "shards": len(list(Path(out).glob("shard-*")))})
    write_report(Path(out) / "builtin", report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-per-category", type=int, default=None)
    ap.add_argument("--shard", type=int, default=0, help="Evaluate questions[shard::num_shards] into OUT/shard-I.")
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--merge", action="store_true", help="Build OUT/builtin/report.json from OUT/shard-*.")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.merge:
        rep = merge(a.out, a.k, {"engine": "builtin", "draft": str(a.draft), "prompts": str(a.prompts),
                                 "temperature": 0.0, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype,
                                 "device": a.device, "seed": 0})
    else:
        out = a.out / f"shard-{a.shard}" if a.num_shards > 1 else a.out
        rep = evaluate(a.draft, a.target, a.prompts, out, a.k, a.device, a.max_prompts,
                       a.max_new_tokens, a.dtype, not a.quiet, a.shard, a.num_shards, a.max_per_category)
        if rep is None:
            return 0
    o = rep["overall"]
    print(json.dumps({"tau": o["tau"], "acceptance_rate_per_pos": o["acceptance_rate_per_pos"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
