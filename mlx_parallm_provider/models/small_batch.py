"""Quantized checkpoints on the CPU: linear layers over the packed weights, at every batch size.

On the CPU, MLX's own ``quantized_matmul`` is slow and its half-precision matmuls slower
still, so the engine multiplies a quantized checkpoint's layers itself, through the MLX
extension (:mod:`.qmatmul_ext`, ops in the step's lazy graph):

* inputs of at most the model's backend's ``packed_rows`` rows (a few streams decoding) go to
  :mod:`.qmatmul`'s C kernel, which reads the packed weights directly (a one-row step is bound
  by memory traffic, and 4-bit weights are an eighth of float32's bytes);
* larger inputs (batched decode, prefill) go to the same op with ``gemm=True``: up to 128
  rows, panels of 16 weight rows dequantized into the core's caches and multiplied there by
  every row of ``x`` (``kernels/qmatmul_gemm.h``); more rows, tiles of the weights dequantized
  for OpenBLAS's GEMM. No float32 copy of the weights is kept: the model holds about its
  checkpoint's size.

With the backend's ``int8_matmul`` (the default where the kernel has its weight tiles, CPUs
with AVX-512 VNNI; :attr:`.DeviceConfig.int8_matmul`) every row count goes to the kernel's integer
path instead: activations quantized in blocks of 32 to ``activation_bits`` (16, two int8
planes: the float path's numerics; or 8, llama.cpp's), integer dot products, no float32 copy,
and a row's result does not depend on the rows beside it.

Otherwise both paths multiply by the same float32 weights (``q * scale + bias``, with scale and bias
cast up first), so they differ only in the order of float additions. Where the extension
does not build (no C++ compiler or nanobind) or no BLAS can be bound, each layer keeps a
float32 copy for large inputs and small ones go to the C kernel through ctypes (each call
then evaluates its input first); the backend's ``float32_weights``
(:attr:`.DeviceConfig.float32_weights`) keeps the copy too. The layers hold the model's
backend (:class:`.backends.CPUKernels`), whose ``packed_rows``
(:attr:`.DeviceConfig.small_batch_rows`, 0 turns the kernel off) and ``qmatmul_threads``
(:attr:`.DeviceConfig.qmatmul_threads`) they read; a model switched to MLX's ops
(:class:`.backends.MLXOps`) multiplies by its float32 copies, or where it has none through
MLX's ``quantized_matmul`` on the same packed weights.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..config import DEVICE_SETTINGS
from . import private_blas, qmatmul, qmatmul_ext

if TYPE_CHECKING:  # (the backends use these ops: a floor above them)
    from .backends import MLXOps

logger = logging.getLogger(__name__)

Kernel = Union[ctypes.CDLL, ModuleType]
"""The ctypes kernel (:func:`.qmatmul.load`) or the MLX extension (:func:`.qmatmul_ext.load`)."""

FLOAT32_ENV = DEVICE_SETTINGS["float32_weights"].env
"""(:attr:`.DeviceConfig.float32_weights`'s variable) 1: keep a float32 copy of each quantized layer for large inputs (OpenBLAS's GEMM over it);
0 or unset: none (the packed weights' panel GEMM, and tiles for prefill). On a 2-core Xeon
with AVX-512, 64 concurrent chat requests ran ~1.16x faster without the copies and one
stream even, with a quarter of the memory (the forced AVX2 build: ~0.88x against OpenBLAS's
AVX-512 GEMM over the copies)."""


def _blas(backend: MLXOps) -> Optional[str]:
    """The BLAS the backend's device config chose (None: the process's)."""
    device = getattr(backend, "device", None)
    return None if device is None else device.blas


def load_kernel() -> Optional[Kernel]:
    """The MLX extension where it builds, else the ctypes kernel, else None (no compiler)."""
    return qmatmul_ext.load() or qmatmul.load()


@dataclass(frozen=True)
class PackedWeight:
    """An affine-quantized (N, K) weight as the kernel reads it: ``mx.array`` for the
    extension (as made, sharing the module's packed bytes), numpy arrays for the ctypes
    kernel (:meth:`for_kernel`)."""

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
        # No copy of the packed bytes (a view of the module's own), none through numpy: the
        # model's weights are held once while it is prepared, not three times.
        arrays = [module.weight.view(mx.uint8), module.scales.astype(mx.float32), module.biases.astype(mx.float32)]
        mx.eval(arrays)
        return cls(packed=arrays[0], scales=arrays[1], biases=arrays[2], bits=module.bits, group_size=module.group_size)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: the weight's shape unpacked."""
        return self.packed.shape[0], self.packed.shape[1] * 8 // self.bits

    def for_kernel(self, kernel: Kernel) -> "PackedWeight":
        """This weight with its arrays as ``kernel`` takes them (numpy copies for the ctypes
        kernel, ``mx.array`` for the extension)."""
        if isinstance(kernel, ctypes.CDLL):
            if isinstance(self.packed, np.ndarray):
                return self
            return replace(self, packed=np.array(self.packed), scales=np.array(self.scales), biases=np.array(self.biases))
        if isinstance(self.packed, mx.array):
            return self
        arrays = [mx.array(a) for a in (self.packed, self.scales, self.biases)]
        mx.eval(arrays)
        return replace(self, packed=arrays[0], scales=arrays[1], biases=arrays[2])

    def matmul(self, kernel: Kernel, x: mx.array, threads: int = 1, gemm: bool = False, int8: int = 0) -> mx.array:
        """``x @ W.T`` through the kernel on ``threads`` threads; ``x`` (..., K) with at most
        :data:`.qmatmul.MAX_ROWS` rows, or any number with ``gemm`` (the extension, once
        :func:`.private_blas.bind_for_gemm` succeeded: tiles of W dequantized for OpenBLAS) or
        with ``int8`` (``x`` quantized in blocks of 32, integer dot products: True or 8 to int8,
        16 to 16 bits as two int8 planes, where :func:`.qmatmul.int8_path` has tiles)."""
        if not isinstance(kernel, ctypes.CDLL):  # the extension: lazy, in the step's graph
            w = self.for_kernel(kernel)
            return kernel.qmatmul(x, w.packed, w.scales, w.biases, self.bits, self.group_size, threads, gemm, int8)
        w = self.for_kernel(kernel)
        rows = np.asarray(x.astype(mx.float32)).reshape(-1, x.shape[-1])
        out = qmatmul.qmatmul(kernel, rows, w.packed, w.scales, w.biases, self.bits, self.group_size, threads, int8)
        return mx.array(out).reshape(*x.shape[:-1], out.shape[-1])


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 1


#: Sibling layers that a model calls on the same input; one kernel call serves them all.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """Packed weights of ``members`` layers that take the same input (a block's q/k/v
    projections, an MLP's gate and up), concatenated: the first of them to see an input
    computes every output in one kernel call, the others slice it. Through ctypes each call
    costs a synchronisation of MLX's lazy graph (~60 us on the CPU), more than the matmul
    itself for small layers.
    The input and output are kept per thread (engines may share a model) until every member
    has taken its columns, no longer: held to the next step, a prefill's outputs (every
    layer's q/k/v and gate/up for every prompt token) stayed in memory, ~500 MB for 64 chat
    prompts on the default model."""

    def __init__(self, packed: PackedWeight, kernel: Kernel, members: int = 1) -> None:
        self.packed, self.kernel, self.members = packed.for_kernel(kernel), kernel, members
        self._last = threading.local()

    def output(self, x: mx.array, threads: int = 1, gemm: bool = False, int8: int = 0,
               member: Optional[tuple[int, int]] = None) -> mx.array:
        """``x @ W.T`` for every member; ``member`` (its columns) says which one asks."""
        if self.members <= 1:
            return self.packed.matmul(self.kernel, x, threads, gemm, int8)
        last = self._last
        if getattr(last, "input", None) is not x or last.how != (gemm, int8):
            last.output = self.packed.matmul(self.kernel, x, threads, gemm, int8)
            last.input, last.how, last.taken = x, (gemm, int8), set()  # the input kept alive, so identity cannot be reused by a new array
        out = last.output
        last.taken.add(member)
        if len(last.taken) >= self.members:  # every member has its columns: hold nothing past this step
            last.input = last.output = None
        return out

    def mlx_matmul(self, x: mx.array) -> mx.array:
        """``x @ W.T`` through MLX's own ``quantized_matmul`` on the packed weights (a model
        switched to :class:`.backends.MLXOps` without float32 copies)."""
        w = self.packed.for_kernel(qmatmul_ext)  # as mx.array
        return mx.quantized_matmul(x, w.packed.view(mx.uint32), w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits)


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` over packed weights (its own, or its columns of a :class:`SharedInput`):
    inputs of at most its backend's ``packed_rows`` rows through the kernel, larger ones
    through the tiled GEMM, or by its float32 ``weight`` where it keeps one."""

    def __init__(self, weight: Optional[mx.array], bias: Optional[mx.array], source: SharedInput, columns: tuple[int, int], backend: MLXOps) -> None:
        start, stop = columns
        super().__init__(source.packed.shape[1], stop - start, bias=bias is not None)
        _hold(self, weight)
        if bias is not None:
            self.bias = bias
        self._source, self._columns = source, columns
        self.backend = backend

    def _extra_repr(self) -> str:
        return f"input_dims={self._source.packed.shape[1]}, output_dims={self._columns[1] - self._columns[0]}, float32_copy={'weight' in self}"

    def __call__(self, x: mx.array) -> mx.array:
        y = _multiply(x, self._source, self._columns, self.weight if "weight" in self else None, self.backend)
        return y + self.bias if "bias" in self else y


class SmallBatchEmbedding(nn.Embedding):
    """``nn.Embedding`` over packed weights: a lookup dequantizes the rows it takes, and
    ``as_linear`` (a tied output head) multiplies as :class:`SmallBatchLinear` does."""

    def __init__(self, weight: Optional[mx.array], packed: PackedWeight, kernel: Kernel, backend: MLXOps) -> None:
        super().__init__(*packed.shape)
        _hold(self, weight)
        self._source = SharedInput(packed, kernel)
        self.backend = backend

    def _extra_repr(self) -> str:
        rows, dims = self._source.packed.shape
        return f"{rows}, {dims}, float32_copy={'weight' in self}"

    def __call__(self, x: mx.array) -> mx.array:
        if "weight" in self:
            return self.weight[x]
        w = self._source.packed.for_kernel(qmatmul_ext)  # as mx.array
        return mx.dequantize(w.packed.view(mx.uint32)[x], w.scales[x], w.biases[x], group_size=w.group_size, bits=w.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return _multiply(x, self._source, (0, self._source.packed.shape[0]), self.weight if "weight" in self else None, self.backend)


def _hold(layer: nn.Module, weight: Optional[mx.array]) -> None:
    """Give ``layer`` its float32 ``weight``, or none: the initial one its ``nn`` base class
    made (lazy, never evaluated) is dropped, so no float32 copy exists."""
    if weight is None:
        del layer["weight"]
    else:
        layer.weight = weight


def _multiply(x: mx.array, source: SharedInput, columns: tuple[int, int], weight: Optional[mx.array], backend: MLXOps) -> mx.array:
    """``x @ W.T`` for a layer's ``columns`` of ``source`` by the path for ``x``'s rows: the
    int8 kernel for every row count where ``backend.int8_matmul``; else the packed kernel for
    at most ``backend.packed_rows``, else the layer's float32 ``weight`` where one is kept,
    MLX's ``quantized_matmul`` on a backend without kernels, or the tiled GEMM."""
    if backend.int8_matmul:
        y = source.output(x, backend.qmatmul_threads, int8=backend.activation_bits, member=columns)
    else:
        small = _rows(x) <= backend.packed_rows
        if not small and weight is not None:
            return private_blas.dense(x, weight)  # the layer's own columns already
        y = source.mlx_matmul(x) if not small and not backend.kernels else source.output(x, backend.qmatmul_threads, gemm=not small, member=columns)
    start, stop = columns
    return y if (start, stop) == (0, y.shape[-1]) else y[..., start:stop]


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
    arrays = [mx.concatenate([getattr(p, name) for p in parts]) for name in ("packed", "scales", "biases")]
    mx.eval(arrays)
    return PackedWeight(packed=arrays[0], scales=arrays[1], biases=arrays[2], bits=first.bits, group_size=first.group_size)


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
                shared, start = SharedInput(joined, kernel, members=len(names)), 0
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
    # A BLAS for the tiles first: the copies are only dropped (and said so) where it is bound.
    # The int8 kernel takes every row count: no copies.
    float32_copy = not backend.int8_matmul and (
        isinstance(kernel, ctypes.CDLL) or not private_blas.bind_for_gemm(_blas(backend)) or backend.float32_weights)
    sources = _sources({n: p for n, p in packed.items() if isinstance(modules[n], nn.QuantizedLinear)}, kernel)
    replaced = []
    for name, weights in packed.items():
        module = modules[name]
        weight = _float32_weight(module) if float32_copy else None
        if isinstance(module, nn.QuantizedLinear):
            bias = module.bias if "bias" in module else None
            replaced.append((name, SmallBatchLinear(weight, bias, *sources[name], backend)))
        else:
            replaced.append((name, SmallBatchEmbedding(weight, weights, kernel, backend)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        how = "ctypes" if isinstance(kernel, ctypes.CDLL) else "MLX extension"
        if backend.int8_matmul:
            logger.info("%d quantized layers: every step through the int8 kernel (%s; no float32 copy)", len(replaced), how)
        else:
            large = "float32 copies" if float32_copy else "tiles of the packed weights dequantized for OpenBLAS (no float32 copy)"
            logger.info("%d quantized layers: steps of <= %d rows through the packed-weight kernel (%s), larger ones through %s",
                        len(replaced), backend.packed_rows, how, large)
    return len(replaced)
