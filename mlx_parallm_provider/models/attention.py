"""Attention routed by the KV cache that holds the keys.

mlx-lm's model files compute attention with ``scaled_dot_product_attention(queries, keys,
values, cache=cache, scale=..., mask=...)``, a name each model module imports from
``mlx_lm.models.base``. :func:`install` points that name, in the loaded model's module, at
:func:`attend`, which lets the cache decide: a cache with an ``attend(queries, keys, values,
scale=..., mask=...)`` method computes attention itself (a shared prefix held once, a CPU
formulation faster than MLX's generic kernel); every other cache gets mlx-lm's own function,
so models and caches this package does not know behave exactly as before.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from mlx_lm.models import base as _base

mlx_lm_attention = _base.scaled_dot_product_attention
"""mlx-lm's function, which :func:`attend` falls back to."""


def attend(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Optional[Any], sinks: Optional[Any] = None) -> Any:
    """``scaled_dot_product_attention`` with the same signature as mlx-lm's, delegating to
    ``cache.attend`` where the cache has one (and the model uses no attention sinks)."""
    own = getattr(cache, "attend", None)
    if own is not None and sinks is None:
        return own(queries, keys, values, scale=scale, mask=mask)
    return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model: Any) -> bool:
    """Route ``model``'s attention through :func:`attend`. Returns whether its module calls
    mlx-lm's function by that name (if not, the model is left alone and caches' ``attend``
    methods are never used, which is correct, only slower)."""
    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is attend:
        return True
    if current is not mlx_lm_attention:
        return False
    module.scaled_dot_product_attention = attend  # type: ignore[union-attr]
    return True
