"""Loss masks derived from chat templates, checked against an independent derivation.

The expected span of each assistant turn is found by locating its content in the rendered text
(str.find) and mapping characters to tokens with the tokenizer's own offsets, plus the one
end-of-turn token after it; eyas instead derives it by rendering prefixes (or from
``{% generation %}`` blocks). The two must agree token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

import tiny
from eyas.data.chat import ChatEncoder
from eyas.data.formats import Skip

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# SmolLM2's own template: note the default system prompt added when there is none.
SMOL_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
DEEPSEEK_V3 = (
    "{{ bos_token }}{%- set ns = namespace(system='') -%}{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] -%}{%- endif -%}{%- endfor -%}"
    "{{ ns.system }}{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)
# Kimi-K2 style: role tags inside the turn, and a default system prompt when there is none.
KIMI = (
    "{%- if messages[0]['role'] != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi, an AI "
    "assistant created by Moonshot AI.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Hides earlier assistant answers once a later one follows (like reasoning-stripping templates).
NOT_INCREMENTAL = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> (template, bos, end-of-turn token, extra special tokens)
STYLES = {
    "llama3": (
        LLAMA3,
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    ),
    "chatml": (SMOL_CHATML, "<|im_start|>", "<|im_end|>", []),
    "gemma": (GEMMA, "<bos>", "<end_of_turn>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]),
    "deepseek_v3": (
        DEEPSEEK_V3,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
    ),
    "kimi": (
        KIMI,
        "[BOS]",
        "<|im_end|>",
        ["[BOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
    ),
    "chatml_generation": (CHATML_GENERATION, "<|im_start|>", "<|im_end|>", []),
}

CONVS = {
    "single": [
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Sunlight scatters off air molecules, blue light the most."},
    ],
    "multi_turn_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany? Answer with code:"},
        {"role": "assistant", "content": "def capital():\n    return 'Berlin'"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome, 100 times over!"},
    ],
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny.make_tokenizer(d, chat_template=None)
    return d


def _tokenizer(base_dir, style):
    from transformers import AutoTokenizer

    template, bos, eot, extra = STYLES[style]
    tok = AutoTokenizer.from_pretrained(base_dir)
    if extra:
        tok.add_tokens(extra, special_tokens=True)
    tok.bos_token = bos
    tok.eos_token = eot
    tok.chat_template = template
    return tok


def _expected_mask(tok, messages, eot_id):
    """Independent derivation: locate each assistant content in the rendering."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = np.zeros(len(ids), dtype=np.int8)
    pos = 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        start = text.find(m["content"], pos)
        assert start >= 0
        end = start + len(m["content"])
        pos = end
        covered = [t for t, (a, b) in enumerate(offsets) if a < end and b > start]
        nxt = covered[-1] + 1
        assert ids[nxt] == eot_id, "the end-of-turn token follows the content"
        mask[covered[0] : nxt + 1] = 1
    return np.array(ids), mask


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("conv", list(CONVS))
def test_mask_matches_independent_spans(base_dir, style, conv):
    tok = _tokenizer(base_dir, style)
    eot_id = tok.convert_tokens_to_ids(STYLES[style][2])
    messages = CONVS[conv]
    if style == "gemma" and conv == "multi_turn_system":
        pass  # gemma folds the system prompt into the first user turn: still alternates
    enc = ChatEncoder(tok, stop_ids=[tok.eos_token_id])
    assert enc.uses_generation_blocks == (style == "chatml_generation")
    (got,) = enc.encode([messages], max_length=4096)
    ids, mask = _expected_mask(tok, messages, eot_id)
    np.testing.assert_array_equal(got.input_ids, ids)
    np.testing.assert_array_equal(got.loss_mask, mask)
    assert not got.truncated
    # the masked tokens decode to exactly the assistant contents, each with its end-of-turn
    runs = np.split(np.arange(len(ids)), np.nonzero(np.diff(mask))[0] + 1)
    texts = [tok.decode(ids[r]) for r in runs if mask[r[0]]]
    assert texts == [m["content"] + STYLES[style][2] for m in messages if m["role"] == "assistant"]


def test_default_system_prompt_is_not_trained(base_dir):
    tok = _tokenizer(base_dir, "chatml")
    (got,) = ChatEncoder(tok).encode([CONVS["single"]], max_length=4096)
    text = tok.decode(got.input_ids)
    assert "You are a helpful AI assistant named SmolLM" in text
    assert "SmolLM" not in tok.decode(got.input_ids[got.loss_mask.astype(bool)])


def test_truncation_keeps_prefix_and_masks_partial_turn(base_dir):
    tok = _tokenizer(base_dir, "llama3")
    messages = CONVS["multi_turn_system"]
    enc = ChatEncoder(tok)
    (full,) = enc.encode([messages], max_length=4096)
    last_start = int(np.nonzero(np.diff(full.loss_mask) == 1)[0][-1]) + 1
    cut = last_start + 3  # three tokens into the last answer
    (got,) = enc.encode([messages], max_length=cut)
    assert got.truncated and len(got.input_ids) == cut
    np.testing.assert_array_equal(got.input_ids, full.input_ids[:cut])
    np.testing.assert_array_equal(got.loss_mask, full.loss_mask[:cut])


def test_long_text_cut_equals_full_encoding(base_dir):
    """Encoding only a character prefix of long conversations gives the same tokens."""
    tok = _tokenizer(base_dir, "chatml")
    long = " ".join(["The quick brown fox jumps over the lazy dog, 12345!"] * 200)  # ~10k chars
    messages = [
        {"role": "user", "content": "Tell me a long story."},
        {"role": "assistant", "content": long},
        {"role": "user", "content": "More."},
        {"role": "assistant", "content": long},
    ]
    enc = ChatEncoder(tok)
    (big,) = enc.encode([messages], max_length=100_000)
    for max_length in (40, 300, 1500):
        (got,) = enc.encode([messages], max_length=max_length)
        assert len(got.input_ids) == max_length and got.truncated
        np.testing.assert_array_equal(got.input_ids, big.input_ids[:max_length])
        np.testing.assert_array_equal(got.loss_mask, big.loss_mask[:max_length])


def test_template_problems_are_skips(base_dir):
    tok = _tokenizer(base_dir, "gemma")
    bad_order = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    good = CONVS["single"]
    out = ChatEncoder(tok).encode([bad_order, good], max_length=512)
    assert isinstance(out[0], Skip) and out[0].reason == "template_error"
    assert "alternate" in out[0].detail
    assert not isinstance(out[1], Skip) and out[1].loss_mask.sum() > 0

    tok2 = _tokenizer(base_dir, "chatml")
    tok2.chat_template = NOT_INCREMENTAL
    out = ChatEncoder(tok2).encode([CONVS["multi_turn_system"], good], max_length=512)
    assert isinstance(out[0], Skip) and out[0].reason == "template_not_incremental"
    assert not isinstance(out[1], Skip)  # one turn only: incremental


def test_no_template_is_a_clear_error(base_dir):
    from transformers import AutoTokenizer

    from eyas.errors import EyasError

    tok = AutoTokenizer.from_pretrained(base_dir)
    with pytest.raises(EyasError, match="--chat-template"):
        ChatEncoder(tok, name="tiny")
    assert ChatEncoder(tok, chat_template=SMOL_CHATML).template == SMOL_CHATML
