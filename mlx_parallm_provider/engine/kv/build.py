"""Building one engine's KV memory: the block tables (:class:`.manager.KVCacheManager`, handed
to the scheduler) and the blocks' arrays (:class:`.storage.PagedKVStorage`, handed to the
runner), sized by the engine's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from .budget import pool_blocks
from .groups import LayerGroups
from .manager import KVCacheManager
from .storage import QUANTIZED_KV_BITS, PagedKVStorage
from .support import layer_windows, with_max_kv_size


@dataclass
class KVMemory:
    """One engine's KV memory: its tables, its arrays, and the layers' windows and groups."""

    manager: KVCacheManager
    storage: PagedKVStorage
    windows: list[Optional[int]]
    groups: Optional[LayerGroups]  # None: one group, a storage slot per layer
    bytes_per_token: int
    num_layers: int

    def stats(self) -> dict[str, Any]:
        """``stats()["kv_cache"]``: blocks, usage, preemptions, bytes."""
        return {"layout": "paged", **self.manager.stats(), "kv_cache_bytes": self.storage.nbytes}

    def prefix_stats(self) -> dict[str, Any]:
        """The prefix store's counts: bytes, tokens, evictions, bound."""
        kv = self.manager
        count = len(kv.windows)  # with groups, a block holds one group's layers: a token takes a block slot in each
        block_bytes = kv.block_size * self.bytes_per_token * self.storage.num_layers // self.num_layers
        cached, bound = kv.num_cached_blocks * block_bytes, kv.max_cached_blocks * block_bytes
        evictions, bs = kv.stats()["prefix_evictions"], kv.block_size
        return {"cached_bytes": cached, "cached_tokens_stored": kv.num_cached_blocks * bs // count, "evictions": evictions,
                "evicted_tokens": evictions * bs // count, "max_bytes": bound, "nbytes": cached, "cached_blocks": kv.num_cached_blocks}


def build_kv(model: Any, budget_bytes: Optional[int], bytes_per_token: int, block_size: int, max_tokens: int,
             max_cached_tokens: Optional[int] = None, max_kv_size: Optional[int] = None,
             kv_dtype: Optional[mx.Dtype] = None, kv_bits: Optional[int] = None) -> KVMemory:
    """KV memory for ``model``: ``budget_bytes`` of blocks (all allocated at once), or, without
    a budget, room for ``max_tokens`` within the free memory, grown on use; at most
    ``max_cached_tokens`` of it named by the prefix cache. ``max_kv_size``: every layer attends
    to at most that many recent tokens, and older blocks are released. Layers of different
    windows (gemma3's local and global) get a group each (:mod:`.groups`): a local group's
    blocks past its window are released too. ``kv_dtype``: the blocks' dtype (None: the
    model's K/V dtype); ``kv_bits``: quantized blocks of 8 or 4 bits instead."""
    layers = len(model.layers)
    windows = with_max_kv_size(layer_windows(model) or [None] * layers, max_kv_size)
    groups = LayerGroups.of(windows)
    # A block holds `groups.size` layers' K/V: a token costs that share of all layers' bytes in each group.
    blocks = pool_blocks(budget_bytes, bytes_per_token * groups.size // layers, block_size, max_tokens * groups.count)
    cached = None if max_cached_tokens is None else max(1, max_cached_tokens * groups.count // block_size)
    manager = KVCacheManager(blocks, block_size, cached, windows=groups.windows)
    storage = PagedKVStorage(groups.size, blocks, block_size, preallocate=budget_bytes is not None, dtype=kv_dtype,
                             bits=kv_bits)
    return KVMemory(manager, storage, windows, groups if groups.count > 1 else None, bytes_per_token, layers)


def kv_for_engine(model: Any, config: Any, bytes_per_token: int, context_length: int) -> KVMemory:
    """The KV memory ``config`` (an :class:`~...config.EngineConfig`) asks for."""
    dtype = config.kv_cache_dtype
    return build_kv(model, config.kv_cache_memory_bytes, bytes_per_token, config.kv_block_size,
                    config.max_num_seqs * max(context_length, 1),
                    max_cached_tokens=config.prefix_cache_memory_bytes // max(1, bytes_per_token), max_kv_size=config.max_kv_size,
                    kv_dtype=None if dtype == "auto" or dtype in QUANTIZED_KV_BITS else getattr(mx, dtype),
                    kv_bits=QUANTIZED_KV_BITS.get(dtype))
