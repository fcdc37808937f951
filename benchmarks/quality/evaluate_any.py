"""`eyas evaluate`'s built-in engine for any draft the comparison produces, on a chosen device.

Same loop, same report as ``eyas evaluate --engine builtin`` (``eyas.evaluate.speculative.
BuiltinEngine`` + ``runner.run_questions`` + ``report.build_report``), with two differences the
comparison needs: the draft is loaded with ``from_speculators.load_draft`` (eyas checkpoints
and converted speculators checkpoints alike), and target and draft are put on ``--device``
(the CLI evaluates on the CPU). Writes OUT/builtin/report.json (+ records, plots).

Usage: python evaluate_any.py --draft D --target T --prompts Q --out O -k 3 [--device cuda]
       [--max-prompts N] [--max-new-tokens 256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def evaluate(draft_dir: Path, target_dir: str, prompts: Path, out: Path, k: int, device: str,
             max_prompts: int | None, max_new_tokens: int, dtype: str, progress: bool = True) -> dict[str, Any]:
    import torch

    from eyas.data.chat import stop_token_ids
    from eyas.evaluate.prompts import read_questions
    from eyas.evaluate.report import build_report, write_report
    from eyas.evaluate.runner import run_questions
    from eyas.evaluate.speculative import BuiltinEngine
    from eyas.target import resolve_target
    from from_speculators import load_draft

    torch_dtype = getattr(torch, dtype)
    target = resolve_target(target_dir)
    tokenizer = target.load_tokenizer()
    stop_ids = set(stop_token_ids(tokenizer, target.path))
    questions = read_questions(prompts, max_prompts)
    model = target.load_model(dtype=torch_dtype, device=device)
    draft = load_draft(draft_dir, device=device, dtype=torch_dtype)
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
    meta = {"engine": "builtin", "target": target.identity, "draft": str(draft_dir),
            "draft_class": type(draft).__name__, "prompts": str(prompts), "temperature": 0.0,
            "max_new_tokens": max_new_tokens, "dtype": dtype, "device": device, "seed": 0}
    report = build_report(records, k, meta)
    write_report(sub, report)
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
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    rep = evaluate(a.draft, a.target, a.prompts, a.out, a.k, a.device, a.max_prompts,
                   a.max_new_tokens, a.dtype, not a.quiet)
    o = rep["overall"]
    print(json.dumps({"tau": o["tau"], "acceptance_rate_per_pos": o["acceptance_rate_per_pos"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
