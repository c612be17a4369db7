"""What a model gets at load: whether quantized weights are dequantized, its backend, and the
BLAS binding where mlx was imported first (the device and the BLAS: :mod:`.device`, whose
names this module re-exports).

On the CPU, ``quantized_matmul`` gains nothing from batching, whereas
float32 weights over OpenBLAS do, so quantized weights are dequantized at load there, with
the packed weights kept for steps of a few rows (:mod:`.small_batch`) and RMSNorm / RoPE
fused into single ops (:mod:`.fused_ops`), where the model's backend is the CPU kernels
(:mod:`.backends`).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import TYPE_CHECKING, Any, Optional

from ..config import ENGINE_SETTINGS, DeviceConfig, default_dequantize
from .device import (  # noqa: F401  (re-exported: the names models/backend.py always had)
    BLAS_ENV,
    OPENBLAS_TIMEOUT,
    OPENBLAS_TIMEOUT_ENV,
    blas_in_use,
    chosen_blas,
    find_openblas,
    is_cpu,
    log_backend_once,
    preload_blas,
    preloaded,
    quiet_openblas_threads,
)

if TYPE_CHECKING:
    from .backends import Choice, MLXOps

logger = logging.getLogger(__name__)

DEQUANTIZE_ENV = ENGINE_SETTINGS["dequantize"].env


def should_dequantize(dequantize: Optional[bool] = None) -> bool:
    """Whether to dequantize weights at load: explicit choice, else the environment's default
    (:attr:`.EngineConfig.dequantize`), else on CPU only."""
    if dequantize is None:
        dequantize = default_dequantize()
    return is_cpu() if dequantize is None else dequantize


def prepare_model(model: Any, dequantize: Optional[bool] = None, kernels: "Choice" = None, *, engine: bool = True,
                  device: Optional[DeviceConfig] = None) -> Any:
    """Apply the load-time choices to a freshly loaded mlx-lm model.

    With ``dequantize`` (by default on the CPU device only) quantized weights are
    dequantized. On the CPU, float16 / bfloat16 weights are upcast too, so everything computes
    in float32: MLX's CPU half-precision matmuls are an order of magnitude slower than float32.
    On a GPU the dequantized weights keep the checkpoint's own precision (its scales' dtype):
    a batched step then reads 16-bit weights once for all its rows, where a quantized matmul
    may read them again for each.
    With ``engine`` (the model is to be served by an engine), a backend is chosen for this
    model alone (``kernels``, see :func:`.backends.choose`: by default the CPU kernels on the
    CPU device, ``device.cpu_kernels`` overriding) and installed on it, set from ``device`` (a
    :class:`.DeviceConfig`, default the environment's); the CPU kernels keep
    quantized layers' packed weights for small steps and fuse RMSNorm / RoPE.
    Where the backend computes with MLX's ops, llama / qwen2 layers' q/k/v and gate/up
    projections quantized alike are then stacked (:mod:`.backends.stacked`;
    ``device.stack_projections``).
    ``engine=False`` leaves mlx-lm's code as it is (the benchmark's mlx-lm peers): only the
    weights are converted. When mlx was imported before this package, dense layers multiply
    through a privately bound OpenBLAS (:mod:`.private_blas`) either way."""
    from . import backends, qmatmul

    device = device or DeviceConfig()
    preload_blas(device.blas)  # done before mlx was imported; warns where this engine asks for another
    qmatmul.configure(device)
    log_backend_once()
    chosen = backends.choose(kernels, device) if engine else None
    if chosen is not None:
        backends.install(model, chosen)
    if should_dequantize(dequantize):
        _dequantize(model, chosen, to_float32=is_cpu())
    if chosen is not None and chosen.stacks_siblings and device.stack_projections:
        from .backends.stacked import stack_siblings

        stack_siblings(model)  # (after dequantizing: only quantized layers stack)
    if is_cpu():
        from .private_blas import install as install_private_blas

        install_private_blas(model, device.blas)  # only when mlx was imported first
    return model


def _dequantize(model: Any, chosen: Optional["MLXOps"], to_float32: bool) -> None:
    """Dequantize (the backend first replacing the quantized layers it computes its own way)
    and, ``to_float32``, upcast to float32."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    has_quantized = any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    if has_quantized:
        if chosen is not None:
            chosen.adapt_quantized(model)
        dequantize_model(model)
    half = {mx.float16, mx.bfloat16}
    upcast = to_float32 and (has_quantized or any(p.dtype in half for _, p in tree_flatten(model.parameters())))
    if upcast:
        model.set_dtype(mx.float32)
    if has_quantized or upcast:
        mx.eval(model.parameters())


def release_load_transients() -> None:
    """Give back what loading a model freed: MLX's buffer cache and, with glibc, the heap's
    free pages (``malloc_trim``). Conversions at load (packing, upcasts) free ~100 MB the
    process would otherwise keep resident for good (the default model: RSS 320 -> 223 MB)."""
    import mlx.core as mx

    mx.clear_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
            pass
