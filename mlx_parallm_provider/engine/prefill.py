"""Batched prefill mechanics: new batch caches, and running prompt tokens into a cache in
pieces, dropping rows that are no longer wanted between pieces. MLX only; which requests
the rows belong to is the worker's business (it passes a ``wanted`` callback)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from .. import mlx_lm_compat
from .shared_kv import SharedPrefixBatchCache

Wanted = Callable[[], list[bool]]
"""Called between pieces: for each row the batch started with, whether it is still wanted."""


def new_batch_cache(num_layers: int, left_padding: list[int], max_kv_size: Optional[int] = None, shared: bool = False) -> list[Any]:
    """An empty left-padded batch cache (rotating when ``max_kv_size`` is set; able to hold
    shared prefixes once when ``shared``, see :mod:`.shared_kv`)."""
    if max_kv_size is not None:
        return [BatchRotatingKVCache(max_kv_size, left_padding) for _ in range(num_layers)]
    if shared:
        return [SharedPrefixBatchCache.fresh(left_padding) for _ in range(num_layers)]
    return [BatchKVCache(left_padding) for _ in range(num_layers)]


def run_pieces(model: Any, tokens: mx.array, cache: list[Any], piece: int, leave_last: bool, wanted: Wanted) -> Optional[tuple[list[int], mx.array]]:
    """Run ``tokens`` (one row per batch row) into ``cache`` ``piece`` columns at a time:
    all of them, or all but the last piece (whose logits the caller wants). Rows no longer
    wanted leave ``tokens`` and ``cache`` between pieces. Returns the indices of the rows
    kept and the tokens not run, or None if every row has gone."""
    kept = list(range(tokens.shape[0]))
    while tokens.shape[1] > (piece if leave_last else 0):
        model(tokens[:, :piece], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[:, piece:]
        flags = wanted()
        keep = [i for i, k in enumerate(kept) if flags[k]]
        if not keep:
            return None
        if len(keep) < len(kept):
            kept = [kept[i] for i in keep]
            tokens = tokens[mx.array(keep)]
            for c in cache:
                c.filter(keep)
                mlx_lm_compat.filter_rotating_lengths(c, keep)
    return kept, tokens


def run_right_padded(model: Any, bodies: Sequence[list[int]], cache: list[Any], pad_id: int, piece: int, wanted: Wanted) -> Optional[list[int]]:
    """Run token runs of different lengths, each directly after what its row of ``cache``
    already holds: right-padded (as mlx-lm's ``BatchGenerator`` does), then the pads are
    rolled to the left (``BatchKVCache.finalize``). Returns the rows kept, or None."""
    width = max(len(b) for b in bodies)
    rotating = isinstance(cache[0], BatchRotatingKVCache)
    if rotating:
        # A one-column piece would take mlx-lm's decode path, which refuses right padding.
        piece = max(piece, 2)
        width += width % piece == 1
    tokens = mx.array([list(b) + [pad_id] * (width - len(b)) for b in bodies])
    if rotating:  # it needs the lengths first, so that pads never push real tokens out of the window
        for c in cache:
            c.prepare(lengths=[len(b) for b in bodies], right_padding=[width - len(b) for b in bodies])
    ran = run_pieces(model, tokens, cache, piece, False, wanted)
    if ran is None:
        return None
    for c in cache:
        if not rotating:
            c.prepare(right_padding=[width - len(bodies[i]) for i in ran[0]])
        c.finalize()
    return ran[0]
