"""Device choice and CPU specifics: which BLAS MLX's CPU backend uses, and whether
quantized weights are dequantized at load.

Measured on 2-core x86 Linux (see ``bench/cpu_backend.py``): the ``mlx[cpu]`` wheel links a
reference BLAS (~4 GFLOP/s f32 matmul); Debian's OpenBLAS loaded with ``RTLD_GLOBAL``
*before* ``mlx`` is imported brings it to ~100+ GFLOP/s. Loading it after ``mlx`` has no
effect, so :func:`preload_blas` runs before this package first imports mlx (importing
:mod:`mlx_parallm_provider.models` or :mod:`mlx_parallm_provider.engine`, e.g. at the first
engine), not when the package itself is imported. On the CPU, ``quantized_matmul`` gains nothing from batching, whereas
float32 weights over OpenBLAS do, so quantized weights are dequantized at load there, with
the packed weights kept for steps of a few rows (:mod:`.small_batch`) and RMSNorm / RoPE
fused into single ops (:mod:`.fused_ops`), where the model's backend is the CPU kernels
(:mod:`.backends`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..config import DEVICE_SETTINGS, ENGINE_SETTINGS, OPENBLAS_TIMEOUT_ENV, DeviceConfig, default_blas, default_dequantize
from ..config import default_environment

if TYPE_CHECKING:
    from .backends import Choice, MLXOps

logger = logging.getLogger(__name__)

BLAS_ENV = DEVICE_SETTINGS["blas"].env
DEQUANTIZE_ENV = ENGINE_SETTINGS["dequantize"].env
OPENBLAS_TIMEOUT = "4"
"""OpenBLAS's worker threads spin 2**N cycles after each call before they sleep (N = 28 by
default, ~70 ms here: through a whole decode step). The spinning thread then competes with
the decode-attention kernel's second thread and anything else on the machine; with N = 4
they sleep at once. Measured at 64 concurrent requests: step 204 -> 188 ms, GEMMs unchanged."""

_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

_preloaded: Optional[str] = None
_preload_done = False
_preload_choice: Optional[str] = None


def find_openblas() -> Optional[str]:
    """Return the path (or soname) of a system OpenBLAS, or None if there is none."""
    for candidate in _OPENBLAS_CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return ctypes.util.find_library("openblas")


def quiet_openblas_threads() -> None:
    """Set ``OPENBLAS_THREAD_TIMEOUT`` to :data:`OPENBLAS_TIMEOUT` unless the user set it
    (OpenBLAS reads it when it loads)."""
    default_environment(OPENBLAS_TIMEOUT_ENV, OPENBLAS_TIMEOUT)


def preloaded() -> Optional[str]:
    """The BLAS :func:`preload_blas` put in the global scope for MLX, or None."""
    return _preloaded


def chosen_blas(choice: Optional[str] = None) -> Optional[str]:
    """The BLAS library ``choice`` (a :attr:`.DeviceConfig.blas`; default the process's,
    ``MLX_PARALLM_BLAS``) asks for: ``auto``, the system OpenBLAS; ``off``, None; else that
    path. None also where none is found, or not on Linux."""
    choice = (default_blas() if choice is None else choice).strip()
    if not sys.platform.startswith("linux") or choice.lower() in ("off", "0", "none", "false"):
        return None
    return find_openblas() if choice.lower() in ("", "auto") else choice


def preload_blas(choice: Optional[str] = None) -> Optional[str]:
    """Load an optimized BLAS globally so MLX's CPU matmuls bind to it, once per process.

    ``choice`` is a :attr:`.DeviceConfig.blas` (default the process's, ``MLX_PARALLM_BLAS``):
    ``auto`` finds OpenBLAS, ``off`` disables the preload, any other value is a library path
    to load. Does nothing off Linux (macOS MLX uses Accelerate), nor once mlx is imported.
    Returns the library loaded, or None. The first call decides; a later one asking for
    another library is warned about."""
    global _preloaded, _preload_done, _preload_choice
    if _preload_done:
        if choice is not None and chosen_blas(choice) != chosen_blas(_preload_choice):
            logger.warning("blas=%r ignored: this process's MLX matmuls already bind to %s (one BLAS per process)",
                           choice, _preloaded or "MLX's own BLAS")
        return _preloaded
    _preload_done = True
    _preload_choice = default_blas() if choice is None else choice
    path = chosen_blas(_preload_choice)
    if path is None:
        return None
    if "mlx.core" in sys.modules:
        logger.info(
            "mlx was imported before mlx_parallm_provider's engine, so %s cannot take over its matmuls; "
            "models multiply through it privately instead (models/private_blas.py)",
            path,
        )
        return None
    quiet_openblas_threads()
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        logger.warning("could not load BLAS %s (%s); DeviceConfig.blas (%s) selects another or 'off'", path, exc, BLAS_ENV)
        return None
    _preloaded = path
    return path


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def blas_in_use() -> str:
    """Describe the BLAS that MLX's CPU matmuls bind to.

    A library in the global symbol scope (one preloaded with ``RTLD_GLOBAL``) wins over the
    reference BLAS that the ``mlx[cpu]`` wheel links privately, so the answer is whichever
    library ``sgemm_`` resolves to globally, if any. (numpy's bundled OpenBLAS uses
    prefixed symbols and does not count.)
    """
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    try:
        process = ctypes.CDLL(None)
        symbol = ctypes.cast(process.sgemm_, ctypes.c_void_p)
        info = _DlInfo()
        if process.dladdr(symbol, ctypes.byref(info)) and info.dli_fname:
            path = info.dli_fname.decode()
            kind = "OpenBLAS" if "openblas" in path.lower() else "BLAS"
            return f"{kind} ({path})"
    except (AttributeError, OSError):
        pass
    return "reference BLAS bundled with mlx"


_logged_blas = False


def log_backend_once() -> None:
    """Log the device and BLAS in use, once per process."""
    global _logged_blas
    if _logged_blas:
        return
    _logged_blas = True
    import mlx.core as mx

    if is_cpu():
        logger.info("mlx device: cpu; BLAS: %s", blas_in_use())
    else:
        logger.info("mlx device: %s", mx.default_device())


def is_cpu() -> bool:
    """True when MLX's default device is the CPU (no Metal or CUDA GPU in use)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


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
    dequantized and float16 / bfloat16 weights upcast, so everything computes in float32:
    MLX's CPU half-precision matmuls are an order of magnitude slower than float32.
    With ``engine`` (the model is to be served by an engine), a backend is chosen for this
    model alone (``kernels``, see :func:`.backends.choose`: by default the CPU kernels on the
    CPU device, ``device.cpu_kernels`` overriding) and installed on it, set from ``device`` (a
    :class:`.DeviceConfig`, default the environment's); the CPU kernels keep
    quantized layers' packed weights for small steps and fuse RMSNorm / RoPE.
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
        _compute_in_float32(model, chosen)
    if is_cpu():
        from .private_blas import install as install_private_blas

        install_private_blas(model, device.blas)  # only when mlx was imported first
    return model


def _compute_in_float32(model: Any, chosen: Optional["MLXOps"]) -> None:
    """Dequantize (the backend first replacing the quantized layers it computes its own way)
    and upcast to float32."""
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
    if has_quantized or any(p.dtype in half for _, p in tree_flatten(model.parameters())):
        model.set_dtype(mx.float32)
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
