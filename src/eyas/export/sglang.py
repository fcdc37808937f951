"""The SGLang / EAGLE ``LlamaForCausalLMEagle3`` directory (vLLM loads it too).

Weights keep the eyas names (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).
Aux layer ids are written twice, one per engine's convention (DESIGN.md section 2):
``eagle_config.eagle_aux_hidden_state_layer_ids`` is read by SGLang, which captures the *output*
of each listed layer (it adds 1 and hooks the next layer's input), so eyas id k is written as
k-1; the top-level ``eagle_aux_hidden_state_layer_ids`` is read by vLLM in eyas's own convention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.draft.checks import DraftCheckpoint
from eyas.export.io import cast, dtype_name, write_model_dir


def llama_layer_config(ckpt: DraftCheckpoint, target_config: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """The draft's one decoder layer as a Llama config (target vocab, num_hidden_layers=1).

    Without ``target_config`` the special token ids come from the draft's record of its target.
    """
    cfg = ckpt.config
    tc = target_config.get("text_config", target_config) if target_config else cfg.target_token_ids
    out = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if tc.get(key) is not None:
            out[key] = tc[key]
    return out


def sglang_aux_ids(aux_ids: list[int]) -> list[int]:
    """eyas/vLLM id k (input of layer k) -> SGLang id k-1 (output of layer k-1)."""
    if any(k < 1 for k in aux_ids):
        raise EyasError(
            f"layer ids {aux_ids}: id 0 (the embeddings) has no SGLang equivalent, "
            "since SGLang names a layer's output; export with --format vllm instead"
        )
    return [k - 1 for k in aux_ids]


def export_sglang(
    ckpt: DraftCheckpoint,
    target_config: dict[str, Any] | None,
    out: Path,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    inputs: dict | None = None,
) -> Path:
    tensors = cast(ckpt.tensors, dtype)
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    cfg = ckpt.config
    if cfg.serving_options:
        opts = ", ".join(cfg.serving_options)
        raise EyasError(
            f"draft {ckpt.path}: trained with {opts}, which SGLang's EAGLE-3 head does not "
            f"have; export with --format vllm (vLLM 0.32 serves it) or train without {opts}"
        )
    config = llama_layer_config(ckpt, target_config, dtype_name(tensors))
    config.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "eagle_config": {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": sglang_aux_ids(list(cfg.aux_layer_ids)),
            },
            "eyas": {
                "format": "sglang",
                "layer_id_convention": "vllm-input-of-layer (top level); sglang output-of-layer (eagle_config)",
                "target": cfg.target,
            },
        }
    )
    return write_model_dir(out, config, tensors, overwrite=overwrite, inputs=inputs)
