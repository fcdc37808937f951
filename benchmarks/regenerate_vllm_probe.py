"""Raw vLLM generation throughput for the target, to size `eyas prepare --regenerate` runs.

Run with the vLLM environment's Python (not eyas's):
    .venvs/vllm-0.32.0/bin/python benchmarks/regenerate_vllm_probe.py TARGET_DIR N_PROMPTS DTYPE
N synthetic one-turn chat prompts, greedy, at most 256 new tokens, all submitted at once.
Prints the generated tokens, the seconds of `generate()` and tokens/s (engine start not timed).
"""

import sys
import time


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    path, n, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = []
    for i in range(n):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"Explain topic number {i} about science and history in detail."}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(ids["input_ids"] if hasattr(ids, "keys") else ids)
    llm = LLM(path, dtype=dtype, max_model_len=2048, seed=0)
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=256, temperature=0))
    dt = time.time() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    print("GEN", got, "tokens", round(dt, 1), "s", round(got / dt, 1), "tok/s")


if __name__ == "__main__":
    main()
