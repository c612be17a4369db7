"""Dequantize a checkpoint for the CPU, keeping its packed weights for steps with few rows.

On the CPU, quantized checkpoints are dequantized to float32 at load: batched decode and
prefill then run as float32 GEMMs over OpenBLAS, far faster than MLX's CPU
``quantized_matmul``. A step with a handful of rows (one stream, a batch draining) is bound by
memory traffic instead, and float32 reads 8x the bytes of 4-bit weights. :func:`dequantize`
keeps each quantized layer's packed weights next to its float32 copy, and its layers send
inputs of at most the model's backend's ``packed_rows`` rows to :mod:`.qmatmul`'s C kernel over the packed
weights, larger ones to the GEMM. The kernel runs as an MLX primitive (:mod:`.qmatmul_ext`,
in the step's lazy graph) where that extension builds, else through ctypes (each call then
evaluates its input first).

Both paths multiply by the same weights: the float32 copy is dequantized in float32 (scale
and bias cast up first), which is what the kernel computes, so they differ only in the order
of float additions. The layers hold the model's backend (:class:`.backends.CPUKernels`), whose
``packed_rows`` (``MLX_PARALLM_SMALL_BATCH_ROWS``, 0 turns the kernel off) and
``qmatmul_threads`` (``MLX_PARALLM_QMATMUL_THREADS``) they read; a model switched to MLX's
ops (:class:`.backends.MLXOps`, ``packed_rows`` 0) multiplies by the float32 copies alone.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from . import private_blas, qmatmul, qmatmul_ext
from .backends import MLXOps

logger = logging.getLogger(__name__)

Kernel = Union[ctypes.CDLL, ModuleType]
"""The ctypes kernel (:func:`.qmatmul.load`) or the MLX extension (:func:`.qmatmul_ext.load`)."""


def load_kernel() -> Optional[Kernel]:
    """The MLX extension where it builds, else the ctypes kernel, else None (no compiler)."""
    return qmatmul_ext.load() or qmatmul.load()


@dataclass(frozen=True)
class PackedWeight:
    """An affine-quantized (N, K) weight as the kernel reads it: numpy arrays for the ctypes
    kernel, ``mx.array`` for the extension (:meth:`for_kernel`)."""

    packed: Any  # (N, K * bits / 8) uint8
    scales: Any  # (N, K / group_size) float32
    biases: Any  # (N, K / group_size) float32
    bits: int
    group_size: int

    @classmethod
    def from_module(cls, module: Any) -> Optional["PackedWeight"]:
        """The packed weight of a ``QuantizedLinear`` / ``QuantizedEmbedding``, or None for a
        layout the kernel does not read (not affine, other bits, group not a multiple of 32)."""
        if getattr(module, "mode", "affine") != "affine" or module.bits not in qmatmul.SUPPORTED_BITS:
            return None
        if module.group_size % 32 or "biases" not in module:
            return None
        weight = np.asarray(module.weight)
        return cls(
            packed=np.ascontiguousarray(weight.view(np.uint8)),
            scales=np.asarray(module.scales.astype(mx.float32)).copy(),
            biases=np.asarray(module.biases.astype(mx.float32)).copy(),
            bits=module.bits,
            group_size=module.group_size,
        )

    def for_kernel(self, kernel: Kernel) -> "PackedWeight":
        """This weight with its arrays as ``kernel`` takes them (``mx.array`` for the extension)."""
        if isinstance(kernel, ctypes.CDLL) or isinstance(self.packed, mx.array):
            return self
        arrays = [mx.array(a) for a in (self.packed, self.scales, self.biases)]
        mx.eval(arrays)
        return replace(self, packed=arrays[0], scales=arrays[1], biases=arrays[2])

    def matmul(self, kernel: Kernel, x: mx.array, threads: int = 1) -> mx.array:
        """``x @ W.T`` through the kernel on ``threads`` threads; ``x`` (..., K) with at most
        :data:`.qmatmul.MAX_ROWS` rows."""
        if not isinstance(kernel, ctypes.CDLL):  # the extension: lazy, in the step's graph
            w = self.for_kernel(kernel)
            return kernel.qmatmul(x, w.packed, w.scales, w.biases, self.bits, self.group_size, threads)
        rows = np.asarray(x.astype(mx.float32)).reshape(-1, x.shape[-1])
        out = qmatmul.qmatmul(kernel, rows, self.packed, self.scales, self.biases, self.bits, self.group_size, threads)
        return mx.array(out).reshape(*x.shape[:-1], out.shape[-1])


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 1


#: Sibling layers that a model calls on the same input; one kernel call serves them all.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """Packed weights of layers that take the same input (a block's q/k/v projections, an
    MLP's gate and up), concatenated: the first of them to see an input computes every
    output in one kernel call, the others slice it. Through ctypes each call costs a
    synchronisation of MLX's lazy graph (~60 us on the CPU), more than the matmul itself for
    small layers.
    The last input and output are kept per thread (engines may share a model)."""

    def __init__(self, packed: PackedWeight, kernel: Kernel) -> None:
        self.packed, self.kernel = packed.for_kernel(kernel), kernel
        self._last = threading.local()

    def output(self, x: mx.array, threads: int = 1) -> mx.array:
        last = self._last
        if getattr(last, "input", None) is not x:
            last.output = self.packed.matmul(self.kernel, x, threads)
            last.input = x  # kept alive, so identity cannot be reused by a new array
        return last.output


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` over float32 weights that multiplies small inputs by the packed copy
    (its own, or its columns of a :class:`SharedInput`) for inputs of at most its backend's
    ``packed_rows`` rows."""

    def __init__(self, weight: mx.array, bias: Optional[mx.array], source: SharedInput, columns: tuple[int, int], backend: MLXOps) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None)
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self._source, self._columns = source, columns
        self.backend = backend

    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) > self.backend.packed_rows:
            return private_blas.dense(x, self.weight, self.bias if "bias" in self else None)
        start, stop = self._columns
        y = self._source.output(x, self.backend.qmatmul_threads)
        if (start, stop) != (0, y.shape[-1]):
            y = y[..., start:stop]
        return y + self.bias if "bias" in self else y


class SmallBatchEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output head) multiplies small inputs by
    the packed copy (as :class:`SmallBatchLinear`)."""

    def __init__(self, weight: mx.array, packed: PackedWeight, kernel: Kernel, backend: MLXOps) -> None:
        super().__init__(weight.shape[0], weight.shape[1])
        self.weight = weight
        self._packed, self._kernel = packed.for_kernel(kernel), kernel
        self.backend = backend

    def as_linear(self, x: mx.array) -> mx.array:
        if _rows(x) > self.backend.packed_rows:
            return private_blas.dense(x, self.weight)
        return self._packed.matmul(self._kernel, x, self.backend.qmatmul_threads)


def _float32_weight(module: Any) -> mx.array:
    """The module's weight dequantized in float32 (what the kernel multiplies by)."""
    return mx.dequantize(
        module.weight, module.scales.astype(mx.float32), module.biases.astype(mx.float32),
        group_size=module.group_size, bits=module.bits, mode=module.mode,
    )


def _concatenated(parts: list[PackedWeight]) -> Optional[PackedWeight]:
    first = parts[0]
    if any((p.bits, p.group_size, p.packed.shape[1]) != (first.bits, first.group_size, first.packed.shape[1]) for p in parts):
        return None
    return PackedWeight(
        packed=np.concatenate([p.packed for p in parts]),
        scales=np.concatenate([p.scales for p in parts]),
        biases=np.concatenate([p.biases for p in parts]),
        bits=first.bits,
        group_size=first.group_size,
    )


def _sources(packed: dict[str, PackedWeight], kernel: Kernel) -> dict[str, tuple[SharedInput, tuple[int, int]]]:
    """Each layer's :class:`SharedInput` and its columns there: siblings (:data:`SIBLINGS`)
    share one where their formats match, other layers get their own."""
    sources: dict[str, tuple[SharedInput, tuple[int, int]]] = {}
    for name in packed:
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in SIBLINGS if leaf in g), None)
        names = [f"{parent}.{n}" if parent else n for n in group] if group else []
        if names and all(n in packed for n in names) and name not in sources:
            joined = _concatenated([packed[n] for n in names])
            if joined is not None:
                shared, start = SharedInput(joined, kernel), 0
                for n in names:
                    stop = start + packed[n].packed.shape[0]
                    sources[n] = (shared, (start, stop))
                    start = stop
        if name not in sources:
            sources[name] = (SharedInput(packed[name], kernel), (0, packed[name].packed.shape[0]))
    return sources


def dequantize(model: nn.Module, backend: MLXOps) -> int:
    """Replace the model's quantized layers that the kernel reads with
    :class:`SmallBatchLinear` / :class:`SmallBatchEmbedding` on ``backend``; returns how many.
    Returns 0 and changes nothing when ``backend.packed_rows`` is 0 or the kernel cannot be
    built (no C compiler); layers it does not read are left for mlx-lm's ``dequantize_model``."""
    kernel = load_kernel() if backend.packed_rows > 0 else None
    if kernel is None:
        return 0
    modules = {name: m for name, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    packed = {name: p for name, m in modules.items() if (p := PackedWeight.from_module(m)) is not None}
    sources = _sources({n: p for n, p in packed.items() if isinstance(modules[n], nn.QuantizedLinear)}, kernel)
    replaced = []
    for name, weights in packed.items():
        module = modules[name]
        weight = _float32_weight(module)
        if isinstance(module, nn.QuantizedLinear):
            bias = module.bias if "bias" in module else None
            replaced.append((name, SmallBatchLinear(weight, bias, *sources[name], backend)))
        else:
            replaced.append((name, SmallBatchEmbedding(weight, weights, kernel, backend)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        how = "ctypes" if isinstance(kernel, ctypes.CDLL) else "MLX extension"
        logger.info("%d quantized layers keep packed weights for steps of <= %d rows (%s kernel)", len(replaced), backend.packed_rows, how)
    return len(replaced)
