"""RMSNorm and RoPE as single CPU ops.

On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` run their fallbacks, graphs of small ops
that cost ~35 and ~90 us a call at one row: ~8 ms of a 30-layer model's ~30 ms batch-1 decode
step; at 64 rows RoPE still costs ~160 us a call against ~40 fused (a 64-row step went from
235 to 206 ms with both fused). :mod:`.qmatmul_ext` also builds both as fused MLX primitives
(``kernels/norm_rope.cpp``). :func:`install` replaces a model's ``nn.RMSNorm`` and plain
``nn.RoPE`` modules (mlx-lm's ``initialize_rope`` for rope types default and linear; llama3,
yarn and the other variants are other classes, left alone) with subclasses that hold the
model's backend and call it: :class:`.backends.CPUKernels` runs the fused ops for float32
inputs, :class:`.backends.MLXOps` (a model switched to MLX's ops) ``mx.fast``'s. Without the
extension nothing is replaced.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from . import qmatmul_ext

if TYPE_CHECKING:  # (the backends use these ops: a floor above them)
    from .backends import MLXOps

logger = logging.getLogger(__name__)


def _inv_freq(dims: int, base: float) -> mx.array:
    """``1 / base ** (2i / dims)`` as ``mx.fast.rope``'s fallback computes it (same ops, float32)."""
    half = dims // 2
    # C++ there: std::log(float base) / half, in float (glibc's logf is correctly rounded).
    step = np.float32(math.log(float(np.float32(base)))) / np.float32(half)
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(float(step), mx.float32))


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by its model's backend (:meth:`.backends.MLXOps.rms_norm`)."""

    def __init__(self, source: nn.RMSNorm, backend: MLXOps) -> None:
        super().__init__(source.weight.shape[0], source.eps)
        self.weight = source.weight
        self.backend = backend

    def __call__(self, x: mx.array) -> mx.array:
        return self.backend.rms_norm(x, self.weight, self.eps)


class FusedRoPE(nn.RoPE):
    """``nn.RoPE`` computed by its model's backend (:meth:`.backends.MLXOps.rope`), with the
    inverse frequencies a kernel takes."""

    def __init__(self, source: nn.RoPE, backend: MLXOps) -> None:
        super().__init__(source.dims, traditional=source.traditional, base=source.base, scale=source.scale)
        self.backend = backend
        self._freq = _inv_freq(source.dims, source.base)
        mx.eval(self._freq)

    @property
    def inv_freq(self) -> mx.array:
        """The inverse frequencies ``(dims / 2,)`` float32, as ``mx.fast.rope``'s fallback computes them."""
        return self._freq

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        return self.backend.rope(x, self.dims, self.traditional, self.base, self.scale, offset, self._freq)


def install(model: nn.Module, backend: MLXOps) -> int:
    """Replace ``model``'s ``nn.RMSNorm`` and plain ``nn.RoPE`` modules with :class:`FusedRMSNorm`
    and :class:`FusedRoPE` on ``backend``; returns how many. Nothing changes (0) without the
    extension."""
    ext = qmatmul_ext.load()
    if ext is None or not hasattr(ext, "rope"):
        return 0
    replaced: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if type(module) is nn.RMSNorm:
            replaced.append((name, FusedRMSNorm(module, backend)))
        elif type(module) is nn.RoPE:
            replaced.append((name, FusedRoPE(module, backend)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        logger.info("%d RMSNorm / RoPE modules use fused CPU ops", len(replaced))
    return len(replaced)
