"""HF hook capture follows the layer-id convention (DESIGN.md section 2) on six architectures."""

from __future__ import annotations

import pytest
import torch

import tiny
from eyas.errors import EyasError
from eyas.features.capture import HiddenStateCapture, find_decoder

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "mistral", "deepseek_v3", "deepseek_v2"]
N_LAYERS = 6
AUX = [0, 2, 4]  # includes id 0 (the embeddings) and an id next to the end


def _model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if arch == "deepseek_v2":  # MLA + MoE, like V3 but V2's modules (tiny.py has no V2)
        from transformers import DeepseekV2Config

        cfg = DeepseekV2Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=512,
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
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=3,
        )
    else:
        cfg = tiny.tiny_config(arch, vocab_size=300, num_layers=N_LAYERS, hidden=64)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _ids(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, _model(request.param)


def test_aux_states_equal_output_hidden_states(arch_model):
    arch, model = arch_model
    ids = _ids([23])[0][None]
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True).hidden_states
    assert len(ref) == N_LAYERS + 1
    with HiddenStateCapture(model, AUX) as cap:
        aux, final = cap.capture(ids)
    assert aux.shape == (1, 23, len(AUX), 64) and final.shape == (1, 23, 64)
    for slot, k in enumerate(AUX):
        torch.testing.assert_close(aux[:, :, slot], ref[k], rtol=0, atol=0, msg=f"{arch} id {k}")
    # ids are distinct states: a mis-indexed hook (e.g. output instead of input) would collide
    assert not torch.allclose(aux[:, :, 1], ref[3], atol=1e-3)


def test_final_is_pre_norm_last_layer_output(arch_model):
    arch, model = arch_model
    ids = _ids([17], seed=2)[0][None]
    decoder, _ = find_decoder(model)
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True).hidden_states
    with HiddenStateCapture(model, AUX) as cap:
        _, final = cap.capture(ids)
    # HF's last entry is after the final norm: ours must differ from it, and become it when normed
    assert not torch.allclose(final, ref[-1], atol=1e-3), arch
    with torch.inference_mode():
        torch.testing.assert_close(decoder.norm(final), ref[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_each_sample_alone(arch_model, side):
    arch, model = arch_model
    seqs = _ids([5, 19, 11, 1], seed=3)
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), 3, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        ids[i, sl], mask[i, sl] = s, 1
    with HiddenStateCapture(model, AUX) as cap:
        batch = cap.capture_into(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            alone = cap.capture_into(s[None])[0]
            sl = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
            torch.testing.assert_close(batch[i, sl], alone, rtol=1e-5, atol=1e-5, msg=f"{arch} {side} row {i}")


def test_right_padding_without_mask_is_exact_for_causal_models(arch_model):
    """The extract loop's fast path: right-pad, no mask; causal attention never sees the pads."""
    arch, model = arch_model
    seqs = _ids([7, 16, 3], seed=4)
    T = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    with HiddenStateCapture(model, AUX) as cap:
        batch = cap.capture_into(ids)
        for i, s in enumerate(seqs):
            alone = cap.capture_into(s[None])[0]
            torch.testing.assert_close(batch[i, : len(s)], alone, rtol=1e-5, atol=1e-5, msg=f"{arch} row {i}")


def test_no_logits_and_hooks_removed():
    model = _model("llama")
    calls = []
    h = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    cap = HiddenStateCapture(model, [1, 2, 3])
    cap.capture(_ids([9])[0][None])
    assert calls == []  # the base model ran alone
    cap.remove()
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in find_decoder(model)[1])
    h.remove()


def test_recording_during_generation_matches_prefill_capture():
    model = _model("qwen3")
    ids = _ids([12], seed=5)[0][None]
    with HiddenStateCapture(model, [1, 3, 5]) as cap:
        aux_ref, final_ref = cap.capture(ids)
        with cap.recording() as recs, torch.inference_mode():
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=3)
    assert len(recs) == 3  # prefill + 2 decode steps (the last token needs no forward)
    aux0, final0 = recs[0]
    torch.testing.assert_close(aux0, aux_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final0, final_ref, rtol=1e-5, atol=1e-5)
    assert recs[1][0].shape[1] == 1  # decode steps record one new position each


def test_bad_layer_ids_are_refused():
    model = _model("llama")
    with pytest.raises(EyasError, match="out of range"):
        HiddenStateCapture(model, [2, N_LAYERS])
    with pytest.raises(EyasError, match="duplicates"):
        HiddenStateCapture(model, [2, 2, 3])
