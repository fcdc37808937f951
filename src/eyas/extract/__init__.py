"""Hidden-state extraction from the target (HF, vLLM) and the on-disk store."""
