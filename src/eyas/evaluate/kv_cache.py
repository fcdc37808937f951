"""The keyword a HF causal LM's ``forward`` takes its KV cache by.

transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40); the
4.x releases eyas supports know only ``past_key_values``. Asked of the model's own signature, so a
model class that keeps the old name is served too."""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=None)
def _name(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(**...)``, with the name this model's forward takes."""
    return {_name(type(model)): cache}
