"""Zero pricing for ``mlx-parallm/<model>`` in LiteLLM's cost map, registered once per model
(by the chat adapter, :mod:`.litellm`, and the embeddings, :mod:`.litellm_embed`)."""

from __future__ import annotations

import threading
from typing import Any, Optional

import litellm

from ._common import PROVIDER

_pricing_lock = threading.Lock()
_priced_models: set[str] = set()


def register_pricing(model: str, context_length: Optional[int] = None) -> None:
    """Register ``mlx-parallm/<model>`` with zero cost, so ``completion_cost`` returns 0.

    LiteLLM's cost map has no wildcards, so each model name is registered (once).
    """
    key = f"{PROVIDER}/{model}"
    with _pricing_lock:
        if key in _priced_models:
            return
        info: dict[str, Any] = {
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "cache_creation_input_token_cost": 0.0,
            "cache_read_input_token_cost": 0.0,
            "litellm_provider": PROVIDER,
            "mode": "chat",
            "supports_function_calling": True,
        }
        if isinstance(context_length, int) and context_length > 0:
            info["max_input_tokens"] = info["max_tokens"] = context_length
        litellm.register_model({key: info})
        _priced_models.add(key)
