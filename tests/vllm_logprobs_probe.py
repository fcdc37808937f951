"""vLLM's own prompt log-probabilities of one token sequence: ``VLLM_PYTHON vllm_logprobs_probe.py MODEL IDS_JSON``.

Runs in the vLLM interpreter with only eyas's worker package on PYTHONPATH (for the config view
that older transformers read right). Nothing of eyas's extraction is involved: when these differ from
HF's, the build's own forward is wrong, not eyas's hooks or connector. Prints one JSON line.
"""

import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    from eyas_vllm_worker.engine import compat_model_dir
    from vllm import LLM, SamplingParams

    ids = [int(x) for x in json.loads(sys.argv[2])]
    model = compat_model_dir(sys.argv[1], Path(tempfile.mkdtemp()))
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max(64, len(ids) + 1),
        seed=0,
    )
    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0)
    )
    lps = out[0].prompt_logprobs
    print("EYAS-LOGPROBS " + json.dumps([None if d is None else d[ids[i]].logprob for i, d in enumerate(lps)]))


if __name__ == "__main__":  # vLLM's engine process is spawned: it re-imports this file
    main()
