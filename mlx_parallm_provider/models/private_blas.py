"""Dense layers over OpenBLAS when ``mlx`` was imported before this package.

MLX's CPU matmuls bind, when ``libmlx`` loads (Python loads extensions with ``RTLD_NOW``),
to whichever ``cblas_sgemm`` is then in the global symbol scope: the system OpenBLAS that
this package preloads before it first imports mlx (:func:`.device.preload_blas`), else the reference
BLAS the ``mlx[cpu]`` wheel bundles, ~30x slower. Most MLX code imports ``mlx`` first. Then
:func:`install` loads OpenBLAS privately (``RTLD_LOCAL``: no symbol of the process changes),
hands its ``cblas_sgemm`` to the extension's ``blas_matmul`` primitive (``kernels/blas_matmul.cpp``)
and replaces the model's ``nn.Linear`` layers and tied output head with ones that multiply
through it, so the model runs as fast as in the other order. Without the extension (no C++
compiler or nanobind) that is impossible, and :func:`install` raises :class:`BackendError`
saying how to fix it. Attention's own matmuls (prefill) stay on MLX's BLAS.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import BackendError
from . import device, qmatmul_ext

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_bound: Optional[Any] = None  # the extension, once its blas_matmul has an sgemm
_library: Optional[ctypes.CDLL] = None  # kept loaded while the process runs


def needed(blas: Optional[str] = None) -> bool:
    """True on the CPU when a BLAS is chosen (``blas``, a :attr:`.DeviceConfig.blas`; default
    the process's, auto: the system OpenBLAS) but was not preloaded for MLX: mlx was imported
    first."""
    return device.is_cpu() and device.chosen_blas(blas) is not None and device.preloaded() is None


def bind(blas: Optional[str] = None) -> bool:
    """Set the extension's ``cblas_sgemm`` to the chosen BLAS's, loaded privately (once);
    False where the library cannot be loaded (logged). Raises :class:`BackendError` without
    the extension."""
    global _bound, _library
    with _lock:
        if _bound is not None:
            return True
        ext = qmatmul_ext.load()
        if ext is None or not hasattr(ext, "set_sgemm"):
            raise BackendError(
                "mlx was imported before mlx_parallm_provider's engine, so MLX's matmuls run on its reference BLAS "
                "(~30x slower), and OpenBLAS cannot be bound otherwise here (the MLX extension did not build: "
                "it needs a C++ compiler and nanobind). Import mlx_parallm_provider.engine (or call get_engine) before "
                f"mlx, or set DeviceConfig.blas='off' ({device.BLAS_ENV}=off) to accept the slow matmuls"
            )
        path = device.chosen_blas(blas)
        device.quiet_openblas_threads()
        try:
            library = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            address = ctypes.cast(library.cblas_sgemm, ctypes.c_void_p).value
        except (OSError, AttributeError, TypeError) as exc:
            logger.warning("could not load cblas_sgemm from %s (%s); matmuls stay on MLX's BLAS", path, exc)
            return False
        ext.set_sgemm(address)
        _bound, _library = ext, library
        logger.info("dense layers multiply through %s, bound privately (mlx was imported first)", path)
        return True


def bind_for_gemm(blas: Optional[str] = None) -> bool:
    """Give the extension a ``cblas_sgemm`` for its tiled GEMM over packed weights
    (:mod:`.small_batch`), in either import order: the one :func:`bind` set, else the
    preloaded BLAS's (the library already in the global scope, so nothing changes for MLX).
    False where there is no extension or no BLAS (logged); :func:`dense` is not affected."""
    ext = qmatmul_ext.load()
    if ext is None or not hasattr(ext, "set_sgemm"):
        return False
    with _lock:
        if ext.has_sgemm():
            return True
    path = device.preloaded()
    if path is None:
        if not needed(blas):
            logger.info("no BLAS was preloaded: quantized layers keep float32 copies for large steps")
            return False
        return bind(blas)
    try:
        address = ctypes.cast(ctypes.CDLL(path).cblas_sgemm, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError) as exc:
        logger.warning("no cblas_sgemm in %s (%s): quantized layers keep float32 copies for large steps", path, exc)
        return False
    with _lock:
        if not ext.has_sgemm():
            ext.set_sgemm(address)
    return True


def dense(x: mx.array, weight: mx.array, bias: Optional[mx.array] = None) -> mx.array:
    """``x @ weight.T (+ bias)``, as ``nn.Linear`` computes it; float32 through the privately
    bound BLAS once :func:`bind` succeeded, MLX's matmul otherwise."""
    if _bound is not None and x.dtype == mx.float32 and weight.dtype == mx.float32 and x.ndim >= 1:
        y = _bound.blas_matmul(x, weight)
        return y if bias is None else y + bias
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


class PrivateBlasLinear(nn.Linear):
    """``nn.Linear`` through :func:`dense`."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__(source.weight.shape[1], source.weight.shape[0], bias="bias" in source)
        self.weight = source.weight
        if "bias" in source:
            self.bias = source.bias

    def __call__(self, x: mx.array) -> mx.array:
        return dense(x, self.weight, self.bias if "bias" in self else None)


class PrivateBlasEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output head) goes through :func:`dense`."""

    def __init__(self, source: nn.Embedding) -> None:
        super().__init__(source.weight.shape[0], source.weight.shape[1])
        self.weight = source.weight

    def as_linear(self, x: mx.array) -> mx.array:
        return dense(x, self.weight)


def install(model: nn.Module, blas: Optional[str] = None) -> int:
    """When :func:`needed` (for ``blas``, the model's :attr:`.DeviceConfig.blas`): bind OpenBLAS privately and replace ``model``'s plain
    ``nn.Linear`` and ``nn.Embedding`` modules with ones that multiply through it; returns
    how many (0 when not needed). Raises :class:`BackendError` when needed but impossible
    (no extension)."""
    if not needed(blas) or not bind(blas):
        return 0
    replaced: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            replaced.append((name, PrivateBlasLinear(module)))
        elif type(module) is nn.Embedding:
            replaced.append((name, PrivateBlasEmbedding(module)))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)
