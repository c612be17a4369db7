"""The device floor of models/: whether MLX computes on the CPU, and which BLAS its CPU
matmuls use.

Measured on 2-core x86 Linux (see ``bench/cpu_backend.py``): the ``mlx[cpu]`` wheel links a
reference BLAS (~4 GFLOP/s f32 matmul); Debian's OpenBLAS loaded with ``RTLD_GLOBAL``
*before* ``mlx`` is imported brings it to ~100+ GFLOP/s. Loading it after ``mlx`` has no
effect, so :func:`preload_blas` runs before this package first imports mlx (importing
:mod:`mlx_parallm_provider.models` or :mod:`mlx_parallm_provider.engine`, e.g. at the first
engine), not when the package itself is imported. Imports nothing of models/ but
:mod:`.config`: the ops, backends and loading above it all read it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from pathlib import Path
from typing import Optional

from ..config import DEVICE_SETTINGS, OPENBLAS_TIMEOUT_ENV, cuda_toolkit, default_blas, default_environment

logger = logging.getLogger(__name__)

BLAS_ENV = DEVICE_SETTINGS["blas"].env
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


def gpu_platform() -> Optional[str]:
    """``"metal"`` or ``"cuda"``: the GPU MLX computes on where its default device is a GPU; else None."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def gpu_memory_free() -> Optional[tuple[int, str]]:
    """Bytes MLX can still allocate on its GPU, and how that was found; None off a GPU or
    where MLX does not say.

    CUDA: the device's free memory (``mx.device_info()``'s ``free_memory``, NVML's
    device-wide figure where NVML loads) plus the buffers MLX keeps cached for reuse. Metal:
    the working set Metal recommends for this GPU (its share of the unified memory) less
    what MLX's arrays hold now. The host's free memory says nothing of either: a CUDA GPU
    has its own, and a Mac's GPU may use only part of the RAM."""
    import mlx.core as mx

    platform = gpu_platform()
    if platform is None:
        return None
    try:
        info = mx.device_info()
    except Exception:  # an MLX without it
        return None
    if platform == "cuda" and isinstance(info.get("free_memory"), int):
        return int(info["free_memory"]) + mx.get_cache_memory(), "the CUDA GPU's free memory"
    limit = info.get("max_recommended_working_set_size")
    if platform == "metal" and isinstance(limit, int):
        return max(0, int(limit) - mx.get_active_memory()), "Metal's recommended working set, less MLX's arrays"
    return None


CUDA_RUNTIME_PACKAGES = ("cu13", "cuda_runtime")
"""Where NVIDIA's CUDA runtime package puts its headers under ``site-packages/nvidia/``:
``nvidia-cuda-runtime`` (CUDA 13) and ``nvidia-cuda-runtime-cu12``."""
SYSTEM_CUDA = Path("/usr/local/cuda")
"""The CUDA toolkit MLX falls back to on Linux."""


def cuda_headers(site: Optional[Path] = None) -> Optional[Path]:
    """The folder of CUDA runtime headers MLX's CUDA backend will compile its kernels (and
    this package's) against, searched as MLX 0.32 searches: NVIDIA's runtime package in
    ``site`` (default: the folder MLX is installed in), then :func:`~..config.cuda_toolkit`
    (``$CUDA_HOME`` / ``$CUDA_PATH``), then ``/usr/local/cuda``. None where none holds
    ``cuda_runtime.h``: the first GPU kernel MLX compiles then fails."""
    if site is None:
        import mlx

        site = Path(list(mlx.__path__)[0]).parent
    toolkit = cuda_toolkit()
    folders = [site / "nvidia" / name for name in CUDA_RUNTIME_PACKAGES]
    folders += [Path(toolkit)] if toolkit else []
    folders.append(SYSTEM_CUDA)
    return next((f / "include" for f in folders if (f / "include" / "cuda_runtime.h").is_file()), None)
