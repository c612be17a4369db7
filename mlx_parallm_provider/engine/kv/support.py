"""Whether a model can run on paged KV, and the row helpers that move KV between the
prefix store and blocks. The one place here that looks at mlx-lm's cache classes."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...config import EngineConfig
from ...models import attention
from .manager import KVCacheManager
from .storage import PagedKVStorage


def unsupported_reason(model: Any, config: EngineConfig) -> Optional[str]:
    """Why ``model`` keeps the rectangle layout under ``config``, or None if it can be paged."""
    if config.kv_layout != "paged":
        return "kv_layout='rectangle'"
    if config.max_kv_size is not None:
        return "max_kv_size (a rotating cache) is set"
    module = sys.modules.get(type(model).__module__)
    if getattr(module, "scaled_dot_product_attention", None) is not attention.attend:
        return f"{type(model).__module__} does not route attention through its cache"
    make_cache = getattr(model, "make_cache", None)
    if make_cache is not None and not all(type(c) is KVCache for c in make_cache()):
        return f"{type(model).__module__} has layers that are not plain KV caches (sliding windows, state)"
    if not hasattr(model, "layers"):
        return "the model has no layers list"
    return None


def slots(storage: PagedKVStorage, kv: KVCacheManager, owner: int, start: int, end: int) -> mx.array:
    """Slots of ``owner``'s tokens ``start:end``."""
    table, bs = kv.table(owner), kv.block_size
    where = [table[t // bs] * bs + t % bs for t in range(start, end)]
    storage.check(max(where, default=0))
    return mx.array(where, dtype=mx.int32)


def write_prefix(storage: PagedKVStorage, kv: KVCacheManager, owner: int, layers_kv: Sequence[tuple[mx.array, mx.array]]) -> None:
    """Copy a fetched prefix (per layer ``(keys, values)`` of ``(1, kv_heads, n, D)``) into
    the first ``n`` tokens of ``owner``'s blocks."""
    n = layers_kv[0][0].shape[2]
    where = slots(storage, kv, owner, 0, n)
    for layer, (k, v) in enumerate(layers_kv):
        storage.write(layer, where, k[0].swapaxes(0, 1), v[0].swapaxes(0, 1))


def read_row(storage: PagedKVStorage, kv: KVCacheManager, owner: int, start: int, end: int) -> list[tuple[mx.array, mx.array]]:
    """``owner``'s K/V of tokens ``start:end`` per layer, as ``(1, kv_heads, n, D)``."""
    where = slots(storage, kv, owner, start, end)
    out = []
    for layer in range(storage.num_layers):
        k, v = storage.read(layer, where)
        out.append((k.swapaxes(0, 1)[None], v.swapaxes(0, 1)[None]))
    return out
