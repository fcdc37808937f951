"""Engine-side code of eyas's vLLM jobs (extract: ``engine``, regenerate: ``generate``, evaluate:
``serve``): runs inside the vLLM Python environment, started by :mod:`eyas.vllm.process`.

This package must import only the standard library, torch, numpy, safetensors and vLLM's
public surface (``vllm.LLM``, ``vllm.SamplingParams``, the KV-connector base classes), and only
*relatively* within itself: eyas copies it next to the job as the top-level package
``eyas_vllm_worker`` and puts that folder on the vLLM interpreter's PYTHONPATH, so nothing of
eyas proper (typer, rich, datasets, transformers 5) is needed there.
"""
