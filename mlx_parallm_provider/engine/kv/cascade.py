"""Cascade attention (Hydragen; FlashInfer's cascade): rows that share a prefix attend to it
as one matmul for all their queries, merged with each row's own tokens by log-sum-exp.

:class:`.paged_cache.PagedLayerCache` uses it for decode rows whose block tables start
with the same cached blocks.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx


class SharedPrefix:
    """One layer's K and V (``[1, kv_heads, tokens, head_dim]``) of a prefix that rows
    share; ``key`` (the prefix's token ids) lets rows joining later find it."""

    __slots__ = ("keys", "values", "key")

    def __init__(self, keys: mx.array, values: mx.array, key: tuple[int, ...]) -> None:
        self.keys, self.values, self.key = keys, values, key

    @property
    def length(self) -> int:
        return self.keys.shape[2]


def _partial(scores: mx.array, values: mx.array, exp: Callable[[mx.array], mx.array]) -> tuple[mx.array, mx.array, mx.array]:
    """Unnormalised softmax-weighted values, the row maxima and the sums of exponentials."""
    m = mx.max(scores, axis=-1, keepdims=True)
    # MLX's CPU exp is scalar (~20 ns an element on x86): the CPU kernels' backend builds it from arithmetic.
    p = exp(scores - m)
    return p @ values, m, mx.sum(p, axis=-1, keepdims=True)


def cascade_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Optional[mx.array],
    groups: list[tuple[SharedPrefix, mx.array]],
    exp: Callable[[mx.array], mx.array] = mx.exp,
) -> mx.array:
    """Attention over shared prefixes + per-row suffixes, merged by log-sum-exp.

    ``queries`` (B, heads, L, D); ``keys`` / ``values`` the rows' own (B, kv_heads, S, D);
    ``mask`` (broadcastable to (B, 1, L, S), True = attend) for the own part only; each
    group's prefix precedes all of its rows' queries, so it needs no mask. ``exp``: the
    model's backend's (:meth:`..models.backends.MLXOps.exp`).
    """
    B, H, L, D = queries.shape
    kv_heads = keys.shape[1]
    rep = H // kv_heads
    work = mx.float32 if queries.dtype != mx.float32 else queries.dtype
    q = (queries * scale).reshape(B, kv_heads, rep * L, D)
    scores = (q @ keys.swapaxes(-1, -2)).astype(work)  # (B, kv_heads, rep*L, S)
    if mask is not None:
        scores = scores.reshape(B, kv_heads, rep, L, -1)
        scores = mx.where(mx.expand_dims(mask, 2) if mask.ndim == 4 else mask, scores, mx.finfo(work).min)
        scores = scores.reshape(B, kv_heads, rep * L, -1)
    num, m, den = _partial(scores, values.astype(work), exp)
    for prefix, rows in groups:
        n = rows.shape[0]
        whole = n == B  # every row shares this prefix: no gather / scatter
        qg = (q if whole else q[rows]).swapaxes(0, 1).reshape(kv_heads, n * rep * L, D)
        sp = (qg @ prefix.keys[0].swapaxes(-1, -2)).astype(work)  # (kv_heads, n*rep*L, P)
        pn, pm, pd = _partial(sp, prefix.values[0].astype(work), exp)
        back = lambda x: x.reshape(kv_heads, n, rep * L, -1).swapaxes(0, 1)  # noqa: E731
        pn, pm, pd = back(pn), back(pm), back(pd)
        sn, sm, sd = (num, m, den) if whole else (num[rows], m[rows], den[rows])
        top = mx.maximum(sm, pm)
        a, b = mx.exp(sm - top), mx.exp(pm - top)
        if whole:
            num, den = sn * a + pn * b, sd * a + pd * b
        else:
            num[rows] = sn * a + pn * b
            den[rows] = sd * a + pd * b
    out = num / den
    return out.reshape(B, H, L, D).astype(queries.dtype)
