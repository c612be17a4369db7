"""Building one engine's KV memory: the block tables (:class:`.manager.KVCacheManager`, handed
to the scheduler) and the blocks' arrays (:class:`.storage.PagedKVStorage`, handed to the
runner), sized by the engine's settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx

from .budget import pool_blocks
from .disk_prefixes import DiskPrefixes
from .disk_tier import DiskKVTier, kv_identity
from .groups import LayerGroups
from .manager import KVCacheManager
from .states import RecurrentStates, StateCheckpoints, StateSlots
from .storage import QUANTIZED_KV_BITS, PagedKVStorage
from .support import layer_windows, pads_states, recurrent_layers, with_max_kv_size

logger = logging.getLogger(__name__)


@dataclass
class KVMemory:
    """One engine's KV memory: its tables, its arrays, and the layers' windows and groups."""

    manager: KVCacheManager
    storage: PagedKVStorage
    windows: list[Optional[int]]
    groups: Optional[LayerGroups]  # None: one group, a storage slot per layer
    bytes_per_token: int
    num_layers: int  # attention layers
    states: Optional[RecurrentStates] = None  # a hybrid model's recurrent layers' states

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks' arrays, and a hybrid model's states (in slots, and kept for its prefix cache)."""
        held = int(self.storage.nbytes)
        if self.states is not None:
            held += self.states.nbytes + (self.states.checkpoints.nbytes if self.states.checkpoints is not None else 0)
        return held

    @property
    def disk(self) -> Optional[DiskKVTier]:
        """The prefix store's disk tier, or None."""
        return self.manager.disk.tier if self.manager.disk is not None else None

    @property
    def loaded_blocks(self) -> int:
        """Blocks brought back from the disk tier so far."""
        return self.manager.disk.loaded_blocks if self.manager.disk is not None else 0

    def close(self) -> None:
        """Write what the disk tier has queued, then stop its writer."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, Any]:
        """``stats()["kv_cache"]``: blocks, usage, preemptions, bytes (and a token's)."""
        stats = {"layout": "paged", **self.manager.stats(), "kv_cache_bytes": self.storage.nbytes, "kv_bytes_per_token": self.bytes_per_token}
        if self.states is not None:
            stats["recurrent_state_bytes"] = self.states.nbytes
            if self.states.checkpoints is not None:
                stats["state_checkpoints"] = len(self.states.checkpoints)
                stats["state_checkpoint_bytes"] = self.states.checkpoints.nbytes
        return stats

    def disk_stats(self) -> Optional[dict[str, Any]]:
        """``stats()["kv_disk"]``: the disk tier's hits, bytes, evictions, skipped files; None without one."""
        if self.disk is None:
            return None
        loaded = self.loaded_blocks
        return {**self.disk.snapshot(), "loaded_blocks": loaded, "loaded_tokens": loaded * self.manager.block_size}

    def tier_stats(self, cached_tokens: int) -> dict[str, dict[str, int]]:
        """Per tier of the prefix store (``memory``, and ``disk`` where there is one): prompt
        tokens found there (``hit_tokens``; ``cached_tokens`` of all tiers), bytes held and
        blocks evicted."""
        memory = self.prefix_stats()
        loaded = self.loaded_blocks * self.manager.block_size
        tiers = {"memory": {"hit_tokens": max(0, cached_tokens - loaded), "bytes": memory["cached_bytes"], "evictions": memory["evictions"]}}
        if self.disk is not None:
            disk = self.disk.snapshot()
            tiers["disk"] = {"hit_tokens": loaded, "bytes": disk["folder_bytes"], "evictions": disk["evictions"]}
        return tiers

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
             kv_dtype: Optional[mx.Dtype] = None, kv_bits: Optional[int] = None,
             disk: Optional[Callable[[list[Optional[int]]], DiskKVTier]] = None,
             state_checkpoint_bytes: Optional[int] = None) -> KVMemory:
    """KV memory for ``model``: ``budget_bytes`` of blocks (all allocated at once), or, without
    a budget, room for ``max_tokens`` within the free memory, grown on use; at most
    ``max_cached_tokens`` of it named by the prefix cache. ``max_kv_size``: every layer attends
    to at most that many recent tokens, and older blocks are released. Layers of different
    windows (gemma3's local and global) get a group each (:mod:`.groups`): a local group's
    blocks past its window are released too. ``kv_dtype``: the blocks' dtype (None: the
    model's K/V dtype); ``kv_bits``: quantized blocks of 8 or 4 bits instead. ``disk``: makes
    the prefix store's disk tier for the layers' windows (one group of layers only). A hybrid
    model's recurrent layers get no blocks but a state slot per request (:mod:`.states`), and
    with ``state_checkpoint_bytes`` (prefix caching) states kept at prompts' checkpoints within
    that many bytes."""
    windows = with_max_kv_size(layer_windows(model) or [None] * len(model.layers), max_kv_size)
    layers = len(windows)
    recurrent = recurrent_layers(model)
    groups = LayerGroups.of(windows)
    tier = None
    if disk is not None and groups.count > 1:
        logger.warning("kv_disk_path: this model mixes sliding-window and global layers; it has no disk tier")
    elif disk is not None:
        tier = disk(windows)
    # A block holds `groups.size` layers' K/V: a token costs that share of all layers' bytes in each group.
    blocks = pool_blocks(budget_bytes, bytes_per_token * groups.size // layers, block_size, max_tokens * groups.count)
    cached = None if max_cached_tokens is None else max(1, max_cached_tokens * groups.count // block_size)
    disk_prefixes = DiskPrefixes(tier) if tier is not None else None
    storage = PagedKVStorage(groups.size, blocks, block_size, preallocate=budget_bytes is not None, dtype=kv_dtype,
                             bits=kv_bits)
    if not recurrent:
        manager = KVCacheManager(blocks, block_size, cached, windows=groups.windows, disk=disk_prefixes)
        return KVMemory(manager, storage, windows, groups if groups.count > 1 else None, bytes_per_token, layers)
    # (Groups of layers match whole blocks in every group's window: no hit there has a kept state.)
    kept = StateCheckpoints(state_checkpoint_bytes) if state_checkpoint_bytes is not None and groups.count == 1 else None
    manager = StateSlots(blocks, block_size, cached, windows=groups.windows, disk=disk_prefixes, checkpoints=kept)
    states = RecurrentStates(recurrent, pads_states(model), kept, block_size=block_size,
                             names=lambda tokens, n, namespace: manager.block_keys(tokens, n, namespace=namespace)[-1])
    return KVMemory(manager, storage, windows, groups if groups.count > 1 else None, bytes_per_token, layers, states)


def kv_for_engine(model: Any, config: Any, bytes_per_token: int, context_length: int, model_path: Optional[Path] = None) -> KVMemory:
    """The KV memory ``config`` (an :class:`~...config.EngineConfig`) asks for (``model_path``:
    the model's files, part of the disk tier's names)."""
    dtype = config.kv_cache_dtype

    def disk(windows: list[Optional[int]]) -> DiskKVTier:
        parts = {"format": 1, "kv_cache_dtype": dtype, "block_size": config.kv_block_size, "windows": windows,
                 "dequantize": config.dequantize, "device": config.device.as_dict(), "model": type(model).__module__,
                 "layers": len(model.layers)}
        return DiskKVTier(config.kv_disk_path, config.kv_disk_bytes, kv_identity(parts, model_path))

    return build_kv(model, config.kv_cache_memory_bytes, bytes_per_token, config.kv_block_size,
                    config.max_num_seqs * max(context_length, 1),
                    max_cached_tokens=config.prefix_cache_memory_bytes // max(1, bytes_per_token), max_kv_size=config.max_kv_size,
                    kv_dtype=None if dtype == "auto" or dtype in QUANTIZED_KV_BITS else getattr(mx, dtype),
                    kv_bits=QUANTIZED_KV_BITS.get(dtype), disk=disk if config.kv_disk_path is not None else None,
                    state_checkpoint_bytes=config.prefix_cache_memory_bytes if config.enable_prefix_caching else None)
