"""Rows of a pass that gathers its KV (no paged kernel for it), grouped by the length they
attend over, each group with its tokens' slots and mask (:class:`.paged_cache.GroupPass`'s buckets)."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .block_pool import NULL_BLOCK

BUCKET_RATIO = 2
"""Rows attend in buckets whose longest row is at most this many times their shortest."""


class Bucket:
    """Rows attended together: the slots of the tokens ``firsts[b]:totals[b]`` of each
    (padded to the bucket's longest span) and their mask."""

    def __init__(self, rows: list[int], tables: Sequence[Sequence[int]], starts: Sequence[int], firsts: Sequence[int],
                 totals: Sequence[int], width: int, bs: int, window: Optional[int] = None) -> None:
        self.rows = rows
        self.index = None if rows == list(range(len(totals))) else mx.array(rows, dtype=mx.int32)
        longest = max(totals[b] - firsts[b] for b in rows)
        blocks = np.full((len(rows), max(len(tables[b]) for b in rows)), NULL_BLOCK, dtype=np.int64)
        for i, b in enumerate(rows):
            blocks[i, : len(tables[b])] = tables[b]
        tokens = np.array([firsts[b] for b in rows])[:, None] + np.arange(longest)[None, :]  # each row's, padded
        real = tokens < np.array([totals[b] for b in rows])[:, None]
        held = np.take_along_axis(blocks, np.where(real, tokens // bs, 0), axis=1)
        self.slots = mx.array(np.where(real, held * bs + tokens % bs, NULL_BLOCK * bs).astype(np.int32))
        key = mx.array(tokens.astype(np.int32))[:, None, :]  # positions (B, 1, S)
        start = mx.array([starts[b] for b in rows])[:, None, None]
        total = mx.array([totals[b] for b in rows])[:, None, None]
        if width == 1:  # the one query sits at total - 1: every gathered key is within its window
            self.mask = (key < total)[:, None]  # (B, 1, 1, S)
        else:
            # Query i of row b sits at start_b + i; queries past the row's end (padding)
            # see the row's real keys only, so they never attend to nothing.
            query = mx.minimum(start + mx.arange(width)[None, :, None], total - 1)
            seen = (key <= query) & (key < total)
            if window is not None:
                seen = seen & (key > query - window)
            self.mask = seen[:, None]  # (B, 1, L, S)


def length_buckets(totals: Sequence[int]) -> list[list[int]]:
    """Rows grouped so that no row attends over more than ``BUCKET_RATIO`` times its length."""
    order = sorted(range(len(totals)), key=lambda b: totals[b])
    buckets: list[list[int]] = []
    for b in order:
        if buckets and totals[b] <= BUCKET_RATIO * max(totals[buckets[-1][0]], 1):
            buckets[-1].append(b)
        else:
            buckets.append([b])
    if len(buckets) == 1:
        return [list(range(len(totals)))]
    return buckets
