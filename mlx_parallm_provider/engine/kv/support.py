"""Whether a model can run on paged KV: the one place in :mod:`.kv` that looks at mlx-lm's
cache classes."""

from __future__ import annotations

from typing import Any, Optional

from mlx_lm.models.cache import KVCache

from ...config import EngineConfig
from ...models import backends


def unsupported_reason(model: Any, config: EngineConfig) -> Optional[str]:
    """Why ``model`` keeps the rectangle layout under ``config``, or None if it can be paged."""
    if config.kv_layout != "paged":
        return "kv_layout='rectangle'"
    if config.max_kv_size is not None:
        return "max_kv_size (a rotating cache) is set"
    if not backends.routes_attention(model):
        return f"{type(model).__module__} does not route attention through its cache"
    if "paged" not in backends.of(model).kv_layouts:
        return f"its backend ({type(backends.of(model)).__name__}) does not attend over paged KV"
    make_cache = getattr(model, "make_cache", None)
    if make_cache is not None and not all(type(c) is KVCache for c in make_cache()):
        return f"{type(model).__module__} has layers that are not plain KV caches (sliding windows, state)"
    if not hasattr(model, "layers"):
        return "the model has no layers list"
    return None
