"""The speculators-style directory: ``vllm serve DIR`` alone serves the verifier with this draft.

vLLM's speculators support reads ``speculators_model_type``, ``transformer_layer_config``,
``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` (defaulting to True when
absent, so it is always written), ``eagle_aux_hidden_state_layer_ids`` (explicit: tiny targets
would get duplicate defaults) and ``speculators_config.verifier`` (the target to load).
Weights use the speculators layout (``layers.0.*``). The head options ``fc_norm``,
``norm_before_fc`` and ``norm_output`` are written only when set (vLLM 0.32 reads them; 0.16 does
not, and ``eyas evaluate --engine vllm`` refuses such a draft on a vLLM that would ignore them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eyas.draft.checks import DraftCheckpoint
from eyas.export.io import cast, dtype_name, write_model_dir
from eyas.export.sglang import llama_layer_config

SPECULATORS_VERSION = "0.3.0"


def export_vllm(
    ckpt: DraftCheckpoint,
    target_config: dict[str, Any] | None,
    out: Path,
    verifier: str,
    dtype: torch.dtype | None = None,
    num_speculative_tokens: int = 3,
    overwrite: bool = False,
    inputs: dict | None = None,
    source_sha256: str | None = None,
) -> Path:
    tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in ckpt.tensors.items()}
    tensors = cast(tensors, dtype)
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    cfg = ckpt.config
    layer = llama_layer_config(ckpt, target_config, dtype_name(tensors))
    layer["architectures"] = ["LlamaForCausalLM"]
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": dtype_name(tensors),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(cfg.target_architectures) or ["LlamaForCausalLM"],
            },
        },
        "eyas": {"format": "vllm", "layer_id_convention": "vllm-input-of-layer", "target": cfg.target},
    }
    if source_sha256:  # which draft this is an export of (`eyas evaluate` checks it before reuse)
        config["eyas"]["source_sha256"] = source_sha256
    for option in cfg.serving_options:  # only when set: vLLM 0.16 reads none of these keys or weights
        config[option] = True
    return write_model_dir(out, config, tensors, overwrite=overwrite, inputs=inputs)
