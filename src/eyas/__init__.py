"""eyas: train EAGLE-3 draft models for a target LLM and hand them to vLLM / SGLang."""

__version__ = "0.1.0"
