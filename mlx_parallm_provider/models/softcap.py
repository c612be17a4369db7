"""Attention with softcapped scores (gemma2's ``attn_logit_softcapping``) by MLX's ops: what
the MLX-ops backend computes and what the paged kernels are checked against."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx


def softcapped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any],
                         softcap: float) -> mx.array:
    """Attention with softcapped scores as mlx-lm's gemma2 computes it (queries scaled, then
    ``softcap * tanh(scores / softcap)``, then the mask, a precise softmax), in the inputs'
    dtype: ``queries`` (B, heads, L, D) over ``keys`` / ``values`` (B, kv_heads, S, D);
    ``mask`` None, ``"causal"``, or a boolean or additive array that broadcasts to (B, 1, L, S)."""
    B, heads, L, D = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    queries = queries * scale
    if repeats > 1:  # each KV head's group of query heads as one more axis
        queries = queries.reshape(B, kv_heads, repeats, L, D)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):  # "causal": query i sits at S - L + i
        mask = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]
    if mask is not None:
        if repeats > 1 and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    return out.reshape(B, heads, L, D) if repeats > 1 else out
