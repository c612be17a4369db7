"""Whether a model can run on paged KV: the one place in :mod:`.kv` that looks at mlx-lm's
cache classes."""

from __future__ import annotations

from typing import Any, Optional

from mlx_lm.models.cache import KVCache, RotatingKVCache

from ...config import EngineConfig
from ...models import backends


GATHERED_MODULES = frozenset({"mlx_lm.models.gemma2"})
"""mlx-lm model modules that compute attention themselves (not through
``scaled_dot_product_attention``) over what the cache's ``update_and_fetch`` returns, under the
mask its ``make_mask`` gives, and nothing else: they run on paged KV with every row's blocks
gathered per layer (:class:`.paged_cache.PagedBatch`'s ``gathered``). Each is checked by the
architecture matrix; a module not listed keeps the rectangle layout."""


def unsupported_reason(model: Any, config: EngineConfig) -> Optional[str]:
    """Why ``model`` keeps the rectangle layout under ``config``, or None if it can be paged."""
    if config.kv_layout != "paged":
        return "kv_layout='rectangle'"
    if not backends.routes_attention(model) and type(model).__module__ not in GATHERED_MODULES:
        return f"{type(model).__module__} does not route attention through its cache"
    if "paged" not in backends.of(model).kv_layouts:
        return f"its backend ({type(backends.of(model)).__name__}) does not attend over paged KV"
    if not hasattr(model, "layers"):
        return "the model has no layers list"
    if layer_windows(model) is None:
        return f"{type(model).__module__} has layers that are not plain or sliding-window KV caches (state, kept tokens)"
    return None


def layer_windows(model: Any) -> Optional[list[Optional[int]]]:
    """Each layer's sliding window (None: it attends to every token), as the caches
    ``model.make_cache()`` builds say (a ``RotatingKVCache`` that keeps no first tokens is a
    window of its size); None if some layer's cache is neither kind."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return [None] * len(model.layers)
    windows: list[Optional[int]] = []
    for cache in make_cache():
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            windows.append(cache.max_size)
        else:
            return None
    return windows


def with_max_kv_size(windows: list[Optional[int]], max_kv_size: Optional[int]) -> list[Optional[int]]:
    """Each layer's window once ``max_kv_size`` bounds every layer to that many recent tokens
    (as mlx-lm's batch rotating cache keeps them: none of the first tokens)."""
    if max_kv_size is None:
        return windows
    return [max_kv_size if w is None else min(w, max_kv_size) for w in windows]
