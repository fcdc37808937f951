"""Tiny real models and tokenizers for tests: built in the test, random weights, a few MB.

`make_tokenizer` trains a byte-level BPE tokenizer on a small text with ChatML specials;
`make_target` saves a random model of a given architecture plus that tokenizer as an HF dir.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Hello! How can I help you today? Please tell me more about your question.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "user assistant system: explain why the sky is blue in one sentence.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 numbers and punctuation , . ; : ! ?",
] * 20


def make_tokenizer(out: Path, chat_template: str | None = CHATML, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<|endoftext|>",
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 384, num_layers: int = 8, hidden: int = 64):
    """A small config of the given family; `arch` in llama, qwen2, qwen3, mistral, gemma3, deepseek_v3."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=3,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=hidden // 4, **common)
    if arch == "mistral":
        return tf.MistralConfig(**common)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(head_dim=hidden // 4, sliding_window=16, **common)
    if arch == "deepseek_v3":
        cfg = dict(common)
        cfg.update(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
        return tf.DeepseekV3Config(**cfg)
    raise ValueError(f"unknown tiny arch {arch!r}")


def make_target(
    out: Path,
    arch: str = "llama",
    num_layers: int = 8,
    hidden: int = 64,
    chat_template: str | None = CHATML,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
) -> Path:
    """Save a random `arch` model with the tiny tokenizer into `out`; returns `out`. ``head_dim``:
    32 is the smallest vLLM's CPU attention takes."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tok = make_tokenizer(out, chat_template=chat_template)
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size=len(tok), num_layers=num_layers, hidden=hidden)
    if head_dim is not None:
        config.head_dim = head_dim
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def random_prepared(path: Path, target, n: int = 48, seed: int = 0, extra_manifest: dict | None = None) -> Path:
    """A prepared dataset of ``n`` random token sequences (12-55 tokens, the last two thirds trained)
    for ``target`` (a resolved eyas Target), with a random 96-token draft vocab."""
    import numpy as np

    from eyas.data.dataset import write_prepared

    rng = np.random.default_rng(seed)
    vocab = target.config()["vocab_size"]
    ids, masks = [], []
    for _ in range(n):
        length = int(rng.integers(12, 56))
        ids.append(rng.integers(4, vocab, length).tolist())
        masks.append([0] * (length // 3) + [1] * (length - length // 3))
    dv = 96
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(rng.permutation(vocab)[:dv])] = True
    d2t = torch.nonzero(t2d).flatten() - torch.arange(dv)
    return write_prepared(path, ids, masks, [f"rand:{i}" for i in range(n)], target, d2t, t2d, extra_manifest)
