"""Prefix reuse with a rotating KV cache (``EngineConfig(max_kv_size=W)``).

mlx-lm's ``BatchRotatingKVCache`` gives every query a window of the last ``W`` tokens. While
fewer than ``W`` tokens have been run, a row holds all of them and nothing has been evicted,
so a fresh cache that has prefilled ``P < W`` tokens holds exactly their KV, left-aligned,
and no later token can tell it from a cache seeded with the same KV. That is the only state
this module reuses: the store keeps at most the first ``W - 1`` tokens of a sequence, taken
from a row only while it still holds its sequence from the first token on, and a row is
seeded with at most ``W - 1`` cached tokens. Each row gets its own copy (no shared prefix
attention with a ring buffer); prompts longer than the window reuse their first ``W - 1``
tokens, since the window only moves once those are in the cache.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from .. import mlx_lm_compat
from .prefix_cache import LayerKV, PrefixCache


def max_reusable_tokens(max_kv_size: int) -> int:
    """The most leading tokens a row of a rotating cache of ``max_kv_size`` may reuse."""
    return max_kv_size - 1


def rotating_batch_from_prefixes(max_kv_size: int, prefixes: Sequence[Optional[list[LayerKV]]], lengths: Sequence[int], num_layers: int) -> list[BatchRotatingKVCache]:
    """A left-padded rotating batch cache whose row ``i`` holds ``prefixes[i]`` (every
    layer's KV of its first ``lengths[i]`` tokens; None for none), just as a fresh rotating
    cache holds them after prefilling those tokens."""
    if max(lengths, default=0) > max_reusable_tokens(max_kv_size):
        raise ValueError(f"a rotating KV cache of {max_kv_size} can reuse at most {max_reusable_tokens(max_kv_size)} tokens")
    per_layer: list[list[RotatingKVCache]] = [[] for _ in range(num_layers)]
    for kv, n in zip(prefixes, lengths):
        for layer, rows in enumerate(per_layer):
            row = RotatingKVCache(max_kv_size)
            if kv is not None and n:
                row.keys, row.values = kv[layer]
                mlx_lm_compat.set_prefilled(row, n)
            rows.append(row)
    return [BatchRotatingKVCache.merge(rows) for rows in per_layer]


def store_rotating_rows(store: PrefixCache, cache: list[BatchRotatingKVCache], sequences: Sequence[list[int]], rows: Sequence[int], bytes_per_token: int) -> None:
    """Store the first (at most ``max_kv_size - 1``) tokens of ``sequences[j]`` from row
    ``rows[j]`` of ``cache``, for each row that still holds its sequence from its first
    token (one whose start has been evicted stores nothing)."""
    first = cache[0]
    mx.eval(first.left_padding, first.offset)
    pads, offsets = first.left_padding.tolist(), first.offset.tolist()
    end = first.max_size if first.rotated else mlx_lm_compat.write_index(first)  # temporal columns in use
    limit = max_reusable_tokens(first.max_size)
    for seq, i in zip(sequences, rows):
        start = pads[i]
        if start < 0 or end - start != offsets[i]:
            continue  # its first tokens have left the window
        n = min(offsets[i], len(seq), limit)
        if n <= 0:
            continue

        def source(a: int, b: int, i: int = i, start: int = start) -> list[LayerKV]:
            return [(_temporal_row(c, c.keys, i)[:, :, start + a : start + b], _temporal_row(c, c.values, i)[:, :, start + a : start + b]) for c in cache]

        store.insert(seq[:n], source, bytes_per_token)


def _temporal_row(cache: BatchRotatingKVCache, array: mx.array, i: int) -> mx.array:
    """Row ``i`` of ``array`` (the cache's keys or values) in temporal order."""
    row = array[i : i + 1]
    return mx.roll(row, -mlx_lm_compat.write_index(cache), axis=2) if cache.rotated else row
