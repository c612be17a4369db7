"""Moving KV between the prefix store and the worker's batch caches.

:func:`batch_cache_from_prefixes` starts a batch of rows from their fetched prefixes;
:func:`store_rows` copies rows of a batch cache into the store. Both are worker-side.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Sequence

from mlx_lm.models.cache import BatchKVCache, KVCache

from ..config import EngineConfig
from .output import RowState
from .prefix_cache import LayerKV, PrefixCache
from .request import Request

logger = logging.getLogger(__name__)

_warned_rotating = False


def make_prefix_cache(config: EngineConfig) -> Optional[PrefixCache]:
    """The prefix store the config asks for, or None (off, or a rotating KV cache, which
    keeps only a window of each row and so cannot be reused; logged once)."""
    global _warned_rotating
    if not config.enable_prefix_caching:
        return None
    if config.max_kv_size is not None:
        if not _warned_rotating:
            logger.warning("prefix caching is off: a rotating KV cache (max_kv_size) cannot reuse a prefix")
            _warned_rotating = True
        return None
    return PrefixCache(config.prefix_cache_memory_bytes)


def prefix_stats(config: EngineConfig, store: Optional[PrefixCache], snapshot: dict[str, Any]) -> dict[str, Any]:
    """``stats()["prefix_cache"]``: whether caching is on, the hit rate (cached / all
    prompt tokens) and cached prompt tokens from the metrics ``snapshot``, and the
    store's own counts (bytes, stored tokens, evictions) when there is one."""
    return {
        "enabled": config.enable_prefix_caching and config.max_kv_size is None,
        "hit_rate": snapshot["prefix_cache_hit_rate"],
        "cached_tokens": snapshot["cached_prompt_tokens"],
        **(store.stats() if store is not None else {}),
    }


def fetch_prefixes(store: Optional[PrefixCache], requests: Sequence[Request], fail: Callable[[Request, Exception], None]) -> None:
    """Put each newly admitted request's ``num_cached`` prefix KV on its row state, taken
    from the store right after planning (before anything this step can evict it). A fault
    is handed to ``fail`` for that request alone."""
    for request in requests:
        state: Optional[RowState] = request.state  # type: ignore[assignment]
        if store is None or not request.num_cached or state is None or state.prefix is not None or state.cache is not None:
            continue
        try:
            state.prefix = store.fetch(request.prompt_ids, request.num_cached)
        except Exception as exc:
            fail(request, exc)


def batch_cache_from_prefixes(num_layers: int, requests: Sequence[Request]) -> list[BatchKVCache]:
    """A left-padded batch cache, one row per request, holding its fetched prefix KV
    (which the request hands over)."""
    per_layer: list[list[KVCache]] = [[] for _ in range(num_layers)]
    for r in requests:
        prefix, r.state.prefix = r.state.prefix, None
        for layer, rows in enumerate(per_layer):
            row = KVCache()
            if prefix:
                row.keys, row.values = prefix[layer]
                row.offset = r.num_cached
            rows.append(row)
    return [BatchKVCache.merge(rows) for rows in per_layer]


def store_rows(
    store: Optional[PrefixCache],
    cache: Optional[list[Any]],
    sequences: Sequence[list[int]],
    rows: Iterable[int],
    bytes_per_token: int,
) -> None:
    """Put the KV of ``sequences[j]`` (row ``rows[j]`` of a left-padded batch cache) into
    the store. A row holds KV for the first ``size - left_padding`` tokens of its sequence
    (a decode row has not run its last sampled token yet). Caching is an optimisation: a
    failure is logged and costs nothing else."""
    if store is None or cache is None:
        return
    try:
        pads = cache[0].left_padding.tolist()
        size = cache[0].size()
        for seq, i in zip(sequences, rows):
            start = pads[i]

            def source(a: int, b: int, i: int = i, start: int = start) -> list[LayerKV]:
                return [(c.keys[i : i + 1, :, start + a : start + b], c.values[i : i + 1, :, start + a : start + b]) for c in cache]

            store.insert(seq[: min(size - start, len(seq))], source, bytes_per_token)
    except Exception:
        logger.exception("could not store KV in the prefix cache")
