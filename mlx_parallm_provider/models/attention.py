"""Attention routed by the KV cache that holds the keys.

mlx-lm's model files compute attention with ``scaled_dot_product_attention(queries, keys,
values, cache=cache, scale=..., mask=...)``, a name each model module imports from
``mlx_lm.models.base``. :func:`install` points that name, in the loaded model's module, at
:func:`attend`, which lets the cache decide: a cache with an ``attend(queries, keys, values,
scale=..., mask=...)`` method computes attention itself (a shared prefix held once);
a quantized cache gets mlx-lm's own function; every other cache gets :func:`dense_attention`,
plain attention over the keys the cache returned (the one place to choose a faster
formulation for a device).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models import base as _base

mlx_lm_attention = _base.scaled_dot_product_attention
"""mlx-lm's function, which :func:`attend` falls back to."""


def dense_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any]) -> mx.array:
    """Plain attention: ``queries`` (B, heads, L, D) over ``keys`` / ``values`` (B, kv_heads,
    S, D), ``mask`` as mlx-lm passes it (None, ``"causal"`` or an array)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attend(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Optional[Any], sinks: Optional[Any] = None) -> Any:
    """``scaled_dot_product_attention`` with the same signature as mlx-lm's, delegating to
    ``cache.attend`` where the cache has one, to mlx-lm for quantized caches and attention
    sinks, and to :func:`dense_attention` otherwise."""
    if sinks is not None or hasattr(cache, "bits"):
        return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    own = getattr(cache, "attend", None)
    if own is not None:
        return own(queries, keys, values, scale=scale, mask=mask)
    return dense_attention(queries, keys, values, scale=scale, mask=mask)


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
