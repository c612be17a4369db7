"""Quantized matmuls over a step's rows as one matrix.

MLX's quantized matmul takes ``x`` of shape ``(B, L, K)`` as B problems of L rows each. On
MLX's CUDA backend (0.32) each problem is its own slice of the kernel's grid: a decode step's
``(rows, 1, K)`` reads and dequantizes every weight once per row, so a step of 64 rows costs
the weight traffic of 64 steps of one. Folded to ``(B * L, K)`` first, the same product is
one problem of B * L rows, and each weight tile is read once for up to 64 rows. (Metal folds
the rows itself where the weight is 2-D; the CPU kernels' layers are their own.)

:func:`folded_methods` gives a routed layer's subclass (:mod:`.routing`) the folding
``__call__`` of ``nn.QuantizedLinear`` and ``as_linear`` of ``nn.QuantizedEmbedding`` (a
tied output head): the layer's own method, called on the folded rows, its output unfolded.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

_FOLDED = {nn.QuantizedLinear: "__call__", nn.QuantizedEmbedding: "as_linear"}
"""The layer classes whose product is folded, and the method computing it."""


def folding(method: Callable[[Any, mx.array], mx.array]) -> Callable[[Any, mx.array], mx.array]:
    """``method(self, x)`` over ``x``'s leading axes folded into one: ``(..., K)`` in as
    ``(n, K)``, the output's last axis kept."""

    @functools.wraps(method)
    def folded(self: Any, x: mx.array) -> mx.array:
        if x.ndim <= 2:
            return method(self, x)
        lead = x.shape[:-1]
        out = method(self, x.reshape(-1, x.shape[-1]))
        return out.reshape(*lead, out.shape[-1])

    return folded


def folded_methods(cls: type) -> dict[str, Callable[..., mx.array]]:
    """The methods a routed subclass of ``cls`` takes to fold its rows: ``{}`` for a class
    other than exactly ``nn.QuantizedLinear`` or ``nn.QuantizedEmbedding`` (a subclass may
    compute its own way)."""
    name = _FOLDED.get(cls)
    return {name: folding(getattr(cls, name))} if name is not None else {}
