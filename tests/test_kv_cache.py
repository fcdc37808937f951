"""The KV cache keyword of a HF forward (eyas.evaluate.kv_cache): the one the model takes, so that
decoding with a cache neither warns nor changes what it computes."""

from __future__ import annotations

import warnings

import torch

from eyas.evaluate.kv_cache import cache_kwargs


def test_a_forward_that_knows_only_the_old_name_gets_it():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return past_key_values

    cache = object()
    assert cache_kwargs(Old(), cache) == {"past_key_values": cache}
    assert Old()(torch.zeros(1, 1), **cache_kwargs(Old(), cache)) is cache


def test_cached_decoding_is_silent_and_equals_the_full_forward(tiny_llama_dir):
    """One token at a time through the cache gives the full forward's last logits, with no
    deprecation warning from transformers (which would mean the old keyword)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1]
        cache = DynamicCache(config=model.config)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model(input_ids=ids[:, :-1], **cache_kwargs(model, cache), use_cache=True)
            step = model(input_ids=ids[:, -1:], **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)
