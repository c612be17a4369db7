"""Faster plain-MLX formulations of the ops that dominate CPU decoding on x86.

Measured on 2-core x86 (``python -m mlx_parallm_provider.bench.cpu_profile``): MLX's CPU
``exp`` (and so ``sigmoid``, ``softmax`` and SiLU) costs ~17 ns per element, about 7x numpy's
vectorised one, while plain arithmetic (``*``, ``+``, ``maximum``, shifts, casts) runs at
~0.2 ns per element; ``where`` and ``floor`` are slow too. At batch 64 those transcendental
ops are most of the attention softmax and of the MLP's gate, so this module computes ``exp``
from arithmetic alone (range reduction to ``2**n * 2**f``, a degree-6 polynomial for
``2**f``, ``2**n`` built from its IEEE-754 bits; relative error < 3e-7, exact 0 far below
the range, as masked scores need) and builds attention and SwiGLU on it:

* :func:`attention`: grouped-query attention as one matmul per KV head (queries reshaped
  to ``(B, kv_heads, q_per_kv * L, D)``; for decoding, keys times queries, so the long
  key matrix is never the transposed operand), an additive mask made by arithmetic instead
  of ``where``, softmax in float32 on the fast ``exp``;
* :func:`swiglu`: ``silu(gate) * x`` with the fast ``exp``.

Every op is a stock MLX op; the arithmetic chains are wrapped in ``mx.compile`` (shapeless),
which fuses them where a C++ compiler is present and runs them op by op where not, so no
build step is needed. :mod:`.attention` uses these on the CPU device only, and only for
tensors of at least :data:`MIN_ELEMENTS` elements: below that (batch-1 decoding) a step is
bound by op dispatch, and MLX's single ops win.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import mlx.core as mx

_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float32 to an integer
_POLY = [math.log(2) ** i / math.factorial(i) for i in range(7)]  # 2**f = e**(f ln 2)
_NEG = 1e30  # an additive mask's "minus infinity" that stays finite in float32 arithmetic

MIN_ELEMENTS = 8192
"""Smallest attention-score or SwiGLU tensor worth the extra ops of these formulations."""


def attention_size(queries: mx.array, keys: mx.array) -> int:
    """Elements of the attention scores of ``queries`` over ``keys``."""
    return queries.shape[0] * queries.shape[1] * queries.shape[2] * keys.shape[2]


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    y = mx.clip(x.astype(mx.float32) * _LOG2E, -127.0, 127.0)
    n = (y + _ROUND) - _ROUND  # nearest integer, so f is in [-0.5, 0.5]
    f = y - n
    p = _POLY[6]
    for c in reversed(_POLY[:6]):
        p = p * f + c
    return p, (n.astype(mx.int32) + 127) << 23  # the bits of 2**n (0.0 when n = -127)


_exp_parts_c = mx.compile(_exp_parts, shapeless=True)


def fast_exp(x: mx.array) -> mx.array:
    """``exp(x)`` in float32 from arithmetic ops only (see the module docstring)."""
    p, bits = _exp_parts_c(x)
    return p * bits.view(mx.float32)  # a view cannot be compiled shapeless


@mx.compile
def _normalise(e: mx.array) -> mx.array:
    return e * mx.reciprocal(e.sum(axis=-1, keepdims=True))


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis in float32, on :func:`fast_exp`."""
    scores = scores.astype(mx.float32)
    return _normalise(fast_exp(scores - scores.max(axis=-1, keepdims=True)))


_silu_gate = mx.compile(lambda gate, x, e: gate * x / (1.0 + e), shapeless=True)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``swiglu``) with :func:`fast_exp`."""
    e = fast_exp(-gate)
    return _silu_gate(gate, x, e.astype(gate.dtype))


def additive_mask(mask: Any, q_len: int, k_len: int, dtype: Any = mx.float32) -> Optional[mx.array]:
    """mlx-lm's attention mask (None, ``"causal"``, a boolean or an additive array) as an
    additive float array broadcastable to ``(B, heads, q_len, k_len)``, or None."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if q_len == 1:
            return None
        rows = mx.arange(k_len - q_len, k_len)[:, None]
        mask = rows >= mx.arange(k_len)[None]
    if mask.dtype == mx.bool_:
        return (mask.astype(dtype) - 1.0) * _NEG  # 0 where kept, -1e30 where masked
    return mask.astype(dtype)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention of ``queries`` (B, heads, L, D) over ``keys`` / ``values`` (B, kv_heads,
    S, D) as mlx-lm computes it, grouped per KV head and on :func:`softmax`."""
    B, heads, L, D = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = (queries * scale).reshape(B, kv_heads, group * L, D)
    if L == 1:  # keys as the left operand: no transposed (S, D) matrix, ~1.7x faster at S=512
        scores = (keys @ q.swapaxes(-1, -2)).swapaxes(-1, -2)
    else:
        scores = q @ keys.swapaxes(-1, -2)
    scores = scores.astype(mx.float32)  # (B, kv_heads, group * L, S)
    bias = additive_mask(mask, L, S)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        if bias.shape[1] != 1:  # a per-head mask: (B, heads, L, S)
            bias = bias.reshape(bias.shape[0], kv_heads, group, *bias.shape[2:])
        else:  # shared by every head: (..., L, S)
            bias = bias.reshape(bias.shape[0], 1, 1, *bias.shape[2:])
        scores = (scores.reshape(B, kv_heads, group, L, S) + bias).reshape(B, kv_heads, group * L, S)
    weights = softmax(scores).astype(values.dtype)
    return (weights @ values).reshape(B, heads, L, values.shape[-1])
