"""Moving KV between the prefix store and the worker's batch caches.

:func:`batch_cache_from_prefixes` starts a batch of rows from their fetched prefixes;
:func:`store_rows` copies rows of a batch cache into the store. Both are worker-side.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any, Callable, Iterable, Optional, Sequence

from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache

from ..config import EngineConfig
from ..models import backends
from .cascade import SharedPrefix
from .output import RowState
from .prefix_cache import LayerKV, PrefixCache, kv_range
from .prefix_match import common_prefix_len
from .request import Request
from .rotating_prefix import max_reusable_tokens, rotating_batch_from_prefixes, store_rotating_rows
from .shared_kv import SharedPrefixBatchCache

logger = logging.getLogger(__name__)

_warned_rotating = False
_warned_copying = False

MIN_SHARED_TOKENS = 32
"""Rows admitted together share one copy of a cached prefix at least this long."""


def make_prefix_cache(config: EngineConfig) -> Optional[PrefixCache]:
    """The prefix store the config asks for, or None when off. With a rotating KV cache
    (``max_kv_size``) each row copies its prefix, of at most ``max_kv_size - 1`` tokens
    (:mod:`.rotating_prefix`; logged once)."""
    global _warned_rotating
    if not config.enable_prefix_caching:
        return None
    if config.max_kv_size is not None and not _warned_rotating:
        logger.warning(
            "rotating KV cache (max_kv_size=%d): cached prefixes are copied into each row and reused up to %d tokens",
            config.max_kv_size, max_reusable_tokens(config.max_kv_size),
        )
        _warned_rotating = True
    return PrefixCache(config.prefix_cache_memory_bytes)


def scheduler_prefix_options(store: Optional[PrefixCache], config: EngineConfig, bytes_per_token: int) -> dict[str, Any]:
    """The :class:`~.scheduler.Scheduler`'s prefix-sharing keyword arguments."""
    return {
        "prefix_match": None if store is None else store.match,
        "prefix_capacity_tokens": config.prefix_cache_memory_bytes // bytes_per_token,
        "prefix_max_tokens": None if config.max_kv_size is None else max_reusable_tokens(config.max_kv_size),
    }


def prefix_stats(config: EngineConfig, store: Optional[dict[str, Any]], snapshot: dict[str, Any]) -> dict[str, Any]:
    """``stats()["prefix_cache"]``: whether caching is on, the hit rate (cached / all
    prompt tokens) and cached prompt tokens from the metrics ``snapshot``, and the
    store's own counts (bytes, stored tokens, evictions, bound) when there is one."""
    counts = {k: v for k, v in (store or {}).items() if k != "nbytes"}
    return {
        "enabled": config.enable_prefix_caching,
        "hit_rate": snapshot["prefix_cache_hit_rate"],
        "cached_tokens": snapshot["cached_prompt_tokens"],
        **counts,
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
            state.prefix = store.fetch_pieces(request.prompt_ids, request.num_cached)
        except Exception as exc:
            fail(request, exc)


def can_share_kv(model: Any, config: EngineConfig) -> bool:
    """Whether rows may hold a shared prefix once (:mod:`.shared_kv`): prefix caching on, no
    rotating KV, the model's attention routed through the cache (by its backend) and
    every layer a plain KV cache. Otherwise each row gets its own copy (logged once)."""
    global _warned_copying
    if not config.enable_prefix_caching or config.max_kv_size is not None:
        return False
    ok = backends.routes_attention(model)
    make_cache = getattr(model, "make_cache", None)
    if ok and make_cache is not None:
        ok = all(type(c) is KVCache for c in make_cache())
    if not ok and not _warned_copying:
        logger.warning("shared prefixes are copied into each row: %s cannot attend to one shared copy", type(model).__name__)
        _warned_copying = True
    return ok


def _share_groups(requests: Sequence[Request]) -> list[tuple[int, list[int]]]:
    """``(shared length, rows)`` for rows whose cached prefixes share at least
    ``MIN_SHARED_TOKENS`` tokens (a row joins a group if that keeps half its length)."""
    groups: list[tuple[int, list[int]]] = []
    for i, r in enumerate(requests):
        if r.num_cached < MIN_SHARED_TOKENS:
            continue
        for g, (length, rows) in enumerate(groups):
            n = common_prefix_len(requests[rows[0]].prompt_ids[:length], r.prompt_ids[: r.num_cached])
            if n >= MIN_SHARED_TOKENS and 2 * n >= length:
                groups[g] = (n, rows + [i])
                break
        else:
            groups.append((r.num_cached, [i]))
    return [g for g in groups if len(g[1]) > 1]


def batch_cache_from_prefixes(num_layers: int, requests: Sequence[Request], share: bool = False, max_kv_size: Optional[int] = None) -> list[Any]:
    """A left-padded batch cache, one row per request, holding its fetched prefix KV
    (which the request hands over). With ``share``, rows admitted together with a common
    cached prefix reference one copy of it (:class:`SharedPrefixBatchCache`): a view of
    the store's arrays where the prefix is one stored piece, so nothing is copied. With
    ``max_kv_size``, a rotating cache with a copy per row (:mod:`.rotating_prefix`)."""
    prefixes = []
    for r in requests:
        prefixes.append(r.state.prefix)
        r.state.prefix = None
    if max_kv_size is not None:
        kv = [kv_range(p, 0, r.num_cached) if p and r.num_cached else None for r, p in zip(requests, prefixes)]
        return rotating_batch_from_prefixes(max_kv_size, kv, [r.num_cached for r in requests], num_layers)
    shared_len = [0] * len(requests)
    shared: list[list[Optional[SharedPrefix]]] = [[None] * len(requests) for _ in range(num_layers)]
    for length, rows in _share_groups(requests) if share else []:
        key = array("q", requests[rows[0]].prompt_ids[:length]).tobytes()
        kv = kv_range(prefixes[rows[0]], 0, length)
        for layer in range(num_layers):
            one = SharedPrefix(*kv[layer], key)
            for i in rows:
                shared[layer][i] = one
        for i in rows:
            shared_len[i] = length
    per_layer: list[list[KVCache]] = [[] for _ in range(num_layers)]
    for i, (r, prefix) in enumerate(zip(requests, prefixes)):
        own = r.num_cached - shared_len[i]
        kv = kv_range(prefix, shared_len[i], r.num_cached) if prefix and own else None
        for layer, rows in enumerate(per_layer):
            row = KVCache()
            if kv is not None:
                row.keys, row.values = kv[layer]
                row.offset = own
            rows.append(row)
    if not share:
        return [BatchKVCache.merge(rows) for rows in per_layer]
    return [SharedPrefixBatchCache(BatchKVCache.merge(rows), shared[layer]) for layer, rows in enumerate(per_layer)]


def adopt_shared_prefixes(cache: Optional[list[Any]], sequences: Sequence[list[int]], joining: list[Any]) -> None:
    """Before the ``joining`` rows are appended to ``cache`` (the decode batch; row i's
    prompt is ``sequences[i]``): a row holding its own copy of a prefix that joining rows
    share (it computed that prefix before they arrived, e.g. the first of a burst or of
    ``n`` samples) switches to their shared copy, so no batch ever widens to that copy."""
    if not cache or not isinstance(cache[0], SharedPrefixBatchCache) or not isinstance(joining[0], SharedPrefixBatchCache):
        return
    offered = {p.key: j for j, p in enumerate(joining[0].prefixes) if p is not None}
    rows: dict[int, int] = {}  # decode row -> a joining row whose prefix it takes
    for i, seq in enumerate(sequences):
        if cache[0].prefixes[i] is not None:
            continue
        for key, j in offered.items():
            length = joining[0].prefixes[j].length
            if len(seq) > length and cache[0].row_length(i) >= length and array("q", seq[:length]).tobytes() == key:
                rows[i] = j
                break
    if rows:
        for mine, theirs in zip(cache, joining):
            mine.adopt({i: theirs.prefixes[j] for i, j in rows.items()})


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
        if isinstance(cache[0], BatchRotatingKVCache):
            store_rotating_rows(store, cache, sequences, list(rows), bytes_per_token)
            return
        if hasattr(cache[0], "row_kv"):
            for seq, i in zip(sequences, rows):

                def shared_source(a: int, b: int, i: int = i) -> list[LayerKV]:
                    return [c.row_kv(i, a, b) for c in cache]

                store.insert(seq[: min(cache[0].row_length(i), len(seq))], shared_source, bytes_per_token)
            return
        pads = cache[0].left_padding.tolist()
        size = cache[0].size()
        for seq, i in zip(sequences, rows):
            start = pads[i]

            def source(a: int, b: int, i: int = i, start: int = start) -> list[LayerKV]:
                return [(c.keys[i : i + 1, :, start + a : start + b], c.values[i : i + 1, :, start + a : start + b]) for c in cache]

            store.insert(seq[: min(size - start, len(seq))], source, bytes_per_token)
    except Exception:
        logger.exception("could not store KV in the prefix cache")
