"""Everything eyas needs to run vLLM, in one place, used by extract, regenerate and evaluate.

- :mod:`eyas.vllm.find`: which interpreter has vLLM (``--vllm-python`` / ``--vllm``,
  ``$EYAS_VLLM_PYTHON``, this Python, the newest ``.venvs/vllm-*``) and which version it is;
- :mod:`eyas.vllm.process`: the one way a vLLM child process is started and talked to;
- ``eyas/vllm/worker/``: the engine-side package (standard library, torch, numpy, safetensors and
  vLLM only), copied next to each job as ``eyas_vllm_worker``.

vLLM pins its own torch and transformers, so it always runs in a child process of its own
interpreter; nothing here imports vLLM.
"""

# eyas's dtype names (--dtype, --model-dtype, --gen-dtype) -> vLLM's
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
