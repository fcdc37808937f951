"""Helpers for the export/evaluate tests: a tiny target vLLM's CPU attention accepts (head_dim 32),
self-distilled training data, and a draft trained for a few steps with `eyas train`'s trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import tiny

AUX = [1, 3, 4]
WORDS = (
    "the quick brown fox jumps over lazy dog speculative decoding drafts tokens small model "
    "verify large hello how can help you today please tell me more about question paris "
    "capital france berlin germany sky blue numbers"
).split()


def make_eval_target(out: Path, seed: int = 0, sharpen: float = 20.0) -> Path:
    """6 layers, H=128, 4 heads -> head_dim 32 (vLLM's CPU attention has no kernel for 16).

    lm_head is scaled by ``sharpen`` so the random model has confident (peaked) next-token
    distributions, like a real LM; a near-uniform one would make every draft look random."""
    from safetensors.torch import load_file, save_file

    tiny.make_target(out, "llama", num_layers=6, hidden=128, seed=seed)
    w = Path(out) / "model.safetensors"
    state = load_file(str(w))
    state["lm_head.weight"] = state["lm_head.weight"] * sharpen
    save_file(state, str(w), metadata={"format": "pt"})
    return Path(out)


def write_questions(path: Path, n: int, seed: int = 0, turns: int = 2) -> Path:
    rng = np.random.default_rng(seed)
    cats = ["writing", "math", "coding"]
    with open(path, "w") as fh:
        for i in range(n):
            ts = [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 10)))) for _ in range(turns)]
            fh.write(json.dumps({"question_id": 100 + i, "category": cats[i % 3], "turns": ts}) + "\n")
    return path


def self_distilled(target, n: int, new_tokens: int = 48, seed: int = 1):
    """Chat prompts + the target's own greedy answers (what makes a draft accept)."""
    tok = target.load_tokenizer()
    model = target.load_model(dtype=torch.float32)
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )[0].tolist()
        ids.append(out)
        masks.append([0] * len(p) + [1] * (len(out) - len(p)))
    return ids, masks


def train_draft(
    target, work: Path, steps: int = 150, n: int = 96, draft_vocab: int = 256, seed: int = 0, **draft_overrides
) -> Path:
    """Prepared self-distilled data -> `eyas train` online for ``steps`` -> RUN_DIR/draft."""
    from eyas.data.dataset import write_prepared
    from eyas.data.vocab import build_draft_vocab, count_trained_tokens
    from eyas.train.trainer import TrainConfig, run as train

    ids, masks = self_distilled(target, n)
    vocab = target.config()["vocab_size"]
    d2t, t2d, _ = build_draft_vocab(count_trained_tokens(ids, masks, vocab), draft_vocab)
    data = write_prepared(work / "data", ids, masks, [f"self:{i}" for i in range(n)], target, d2t, t2d)
    cfg = TrainConfig(
        target=str(target.path),
        data=str(data),
        out=str(work / "run"),
        features="online",
        layers=AUX,
        ttt_steps=3,
        tokens_per_batch=512,
        max_steps=steps,
        warmup=10,
        lr=3e-3,
        save_every=10_000,
        eval_every=0,
        eval_batches=1,
        heldout=0.05,
        progress=False,
        seed=seed,
        epochs=100,
        draft_config=draft_overrides,
        experimental=bool(draft_overrides),
    )  # the head options are experimental
    return Path(train(cfg))


def session_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(eval target dir, trained draft dir), built once per pytest session and shared by files."""
    base = tmp_path_factory.getbasetemp() / "evalkit"
    tdir, done = base / "target", base / "target.done"
    if not done.exists():
        make_eval_target(tdir)
        done.write_text("ok")
    draft = base / "work" / "run" / "draft"
    if not (draft / "model.safetensors").exists():
        from eyas.target import resolve_target

        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train_draft(resolve_target(tdir), base / "work", steps=80, n=48)
        finally:
            torch.set_num_threads(n)
    return tdir, draft


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        s = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(s, add_special_tokens=False)["input_ids"])
    return out


PROMPTS = [
    "hello how can you help",
    "paris capital of france blue sky",
    "numbers dog fox",
    "tell me more about the lazy dog",
    "speculative decoding verify tokens",
]
