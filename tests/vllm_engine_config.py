"""Run by a vLLM env's python: build (not start) the engine config for TARGET + EAGLE-3 DRAFT and
print what vLLM made of the draft directory (one EYAS-JSON line)."""

import json
import sys

if __name__ == "__main__":
    from vllm.engine.arg_utils import EngineArgs

    target, draft = sys.argv[1], sys.argv[2]
    ea = EngineArgs(
        model=target,
        skip_tokenizer_init=True,
        enforce_eager=True,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
    )
    cfg = ea.create_engine_config()
    sc = cfg.speculative_config
    hf = sc.draft_model_config.hf_config
    print(
        "EYAS-JSON "
        + json.dumps(
            {
                "method": sc.method,
                "k": sc.num_speculative_tokens,
                "architectures": list(hf.architectures or []),
                "aux": list(getattr(hf, "eagle_aux_hidden_state_layer_ids", []) or []),
                "draft_vocab_size": getattr(hf, "draft_vocab_size", None),
                "target_hidden_size": getattr(hf, "target_hidden_size", None),
                "norm_before_residual": getattr(hf, "norm_before_residual", None),
            }
        )
    )
