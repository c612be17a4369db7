"""Whether a model can run on paged KV: the one place in :mod:`.kv` that looks at mlx-lm's
cache classes."""

from __future__ import annotations

from typing import Any, Optional

from mlx_lm.models.cache import KVCache, RotatingKVCache

from ...errors import UnsupportedModelError


def unsupported_reason(model: Any) -> Optional[str]:
    """Why ``model`` cannot run on paged KV (so cannot be served), or None if it can. A model
    whose attention is not routed through its backend (a module computing it itself that
    :mod:`...models.backends.routing` does not know) gets every row's blocks gathered per layer
    (:class:`.paged_cache.PagedBatch`'s ``gathered``), as mlx-lm's batch cache gives them."""
    if not hasattr(model, "layers"):
        return "the model has no layers list"
    if layer_windows(model) is None:
        return (f"{type(model).__module__} has layers whose cache is not a KV cache (state-space or "
                "linear-attention layers, kept first tokens): only attention KV caches are served")
    return None


def ensure_servable(model: Any, name: str) -> None:
    """Raise :class:`~mlx_parallm_provider.errors.UnsupportedModelError` (at load, not at the
    first request) if ``model`` cannot be served, saying why."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedModelError(f"model {name!r} cannot be served: {reason}")


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
