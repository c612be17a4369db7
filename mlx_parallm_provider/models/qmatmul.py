"""A C kernel for ``x @ W.T`` with a few rows of ``x`` and affine-quantized ``W``, on the CPU.

Decoding a handful of rows reads every weight once per step, so on the CPU the step is bound
by memory traffic. The engine dequantizes checkpoints to float32 there (batched GEMMs over
OpenBLAS need it), which makes a one-row step read 8x the bytes of the checkpoint's 4-bit
weights, and MLX's own CPU ``quantized_matmul`` is slower still. ``kernels/qmatmul.c`` reads
the packed weights directly (see :mod:`.small_batch` for where it is used).

The kernel is compiled on first use with the system C compiler (``$CC``, else ``cc``) for
the machine it runs on (or :attr:`.DeviceConfig.kernel_march`), and cached under
``$MLX_PARALLM_HOME/kernels`` (default
``~/.cache/mlx-parallm/kernels``, written atomically and checked against its recorded size
and sha256 before it is loaded, see :mod:`.kernel_cache`); ``scripts/setup.sh`` builds it at
install. Without a compiler or a writable cache :func:`load` returns None and callers keep
MLX's ops. ``python -m
mlx_parallm_provider.models.qmatmul`` builds it and prints where.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional, TypeVar

import numpy as np

from ..config import DEVICE_SETTINGS, MARCH_PATTERN, DeviceConfig, c_compiler, cache_home
from ..cpu_info import cpuinfo_text
from . import kernel_cache

logger = logging.getLogger(__name__)
T = TypeVar("T")

SOURCE = Path(__file__).with_name("kernels") / "qmatmul.c"
INT8_HEADER = SOURCE.with_name("qmatmul_int8.h")  # included by SOURCE: its int8 path
TILES_HEADER = SOURCE.with_name("qmatmul_tiles.h")  # included by SOURCE: its int8 path on AVX-512 VNNI / AMX
GEMM_HEADER = SOURCE.with_name("qmatmul_gemm.h")  # included by SOURCE: its many-row path
LANE_SUMS_HEADER = SOURCE.with_name("lane_sums.h")  # included by INT8_HEADER (and the extension's attention)


def source_text() -> str:
    """The kernel's source, its included headers too (what a cached build is keyed by)."""
    return "\0".join(path.read_text() for path in (SOURCE, INT8_HEADER, TILES_HEADER, GEMM_HEADER, LANE_SUMS_HEADER))

MAX_ROWS = 64
"""Rows of ``x`` one call takes (the C kernel's ``MAX_CALL_ROWS``)."""
SUPPORTED_BITS = (4, 8)

_FLAGS = ["-O3", "-shared", "-fPIC", "-pthread", "-fno-signed-zeros", "-fno-trapping-math"]
# (no -fassociative-math: it let GCC sum the int8 path's lanes in a different order in a whole
# tile of rows than in a partial one, so a row's result depended on the rows beside it)


MARCH_ENV = DEVICE_SETTINGS["kernel_march"].env
""":attr:`.DeviceConfig.kernel_march`'s variable: an ``-march`` value for the kernels instead of ``native``: a lesser ISA of this CPU, e.g.
``x86-64-v3`` (AVX2 + FMA) on an AVX-512 machine, to run and measure that path here."""

# Compiler macros of vector features -> the /proc/cpuinfo flag (x86) or Features entry (arm64)
# the CPU must report for code built with them to run.
_FEATURE_FLAGS = {
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI2__": "bmi2",
    "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni", "__AVXVNNI__": "avx_vnni", "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8", "__AMX_BF16__": "amx_bf16",
    "__ARM_FEATURE_DOTPROD": "asimddp", "__ARM_FEATURE_MATMUL_INT8": "i8mm", "__ARM_FEATURE_SVE": "sve",
    "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp",
}


def cpu_flags() -> set[str]:
    """The vector features the CPU reports (``flags`` on x86, ``Features`` on arm64)."""
    text = cpuinfo_text()
    if text is None:
        return set()
    return {f for ln in text.splitlines() if ln.startswith(("flags", "Features")) for f in ln.split(":", 1)[1].split()}


def march_problem(compiler: str, march: str) -> Optional[str]:
    """Why kernels built with ``-march=march`` cannot run here (None: they can): a value
    that is no plain ISA name, one the compiler does not know, or features this CPU lacks."""
    if not re.fullmatch(MARCH_PATTERN, march):
        return "not an -march name"
    macros = isa_macros(compiler, [f"-march={march}"])
    if macros is None:
        return f"{compiler} does not know it"
    have = cpu_flags()
    missing = sorted(flag for macro, flag in _FEATURE_FLAGS.items() if macro in macros and flag not in have)
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def isa_macros(compiler: str, flags: list[str]) -> Optional[set[str]]:
    """The vector-feature macros the kernels' sources test (``__AVX2__``, ``__AVX512F__``, ...)
    that ``compiler`` defines with ``flags``; None where it rejects the flags."""
    probe = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    return {line.split()[1] for line in probe.stdout.splitlines() if line.startswith("#define ")} & _FEATURE_FLAGS.keys()


_warned: set[tuple[str, str]] = set()
_settings_lock = threading.Lock()
_march: Optional[tuple[Optional[str]]] = None  # (the process's kernel_march,) once configure() ran
_amx: Optional[bool] = None  # the process's DeviceConfig.amx once configure() ran
_amx_switches: list[Callable[[int], object]] = []  # each loaded kernel's qm_amx


def configure(device: DeviceConfig) -> None:
    """Take ``device``'s per-process kernel options: ``kernel_march`` (the first engine's, until
    :func:`reset`; another later is warned about) and ``amx`` (set on the kernels loaded now
    and on those loaded later: the last engine's)."""
    global _march, _amx
    with _settings_lock:
        if _march is None:
            _march = (device.kernel_march,)
        elif _march[0] != device.kernel_march and ("configure", str(device.kernel_march)) not in _warned:
            _warned.add(("configure", str(device.kernel_march)))
            logger.warning("kernel_march=%r ignored: this process's kernels are built for %r (one build per process)",
                           device.kernel_march, _march[0] or "native")
        _amx = device.amx
        switches = list(_amx_switches)
    for switch in switches:
        switch(int(device.amx))


def amx_setting() -> bool:
    """The process's :attr:`.DeviceConfig.amx`: the last :func:`configure`'s, else the environment's."""
    return DeviceConfig().amx if _amx is None else _amx


def add_amx_switch(switch: Callable[[int], object]) -> None:
    """Register a loaded kernel's ``qm_amx`` (0 off, 1 on where Linux gives it), and turn AMX
    off on it now where :func:`amx_setting` says so (before any int8 call)."""
    if not amx_setting():
        switch(0)
    with _settings_lock:
        _amx_switches.append(switch)


def kernel_march() -> Optional[str]:
    """The ``-march`` value the kernels are built with (None: native): the first configured
    engine's :attr:`.DeviceConfig.kernel_march`, else the environment's default."""
    return _march[0] if _march is not None else DeviceConfig().kernel_march


def native_flags(compiler: str) -> list[str]:
    """``-march=native`` where the compiler takes it (GCC/Clang on x86 and ARM Linux), or
    the ISA :func:`kernel_march` names where this CPU runs it (else warned and ignored)."""
    march = kernel_march()
    if march and march != "native":
        problem = march_problem(compiler, march)
        if problem is None:
            return [f"-march={march}"]
        if (march, problem) not in _warned:  # once: every kernel build asks
            _warned.add((march, problem))
            logger.warning("kernel_march %s (%s) ignored (%s): the kernels are built for this CPU (-march=native)", march, MARCH_ENV,
                           problem)
    probe = subprocess.run([compiler, "-march=native", "-x", "c", "-E", "-", "-o", os.devnull], input="", capture_output=True, text=True)
    return ["-march=native"] if probe.returncode == 0 else []


def c_flags(compiler: str) -> list[str]:
    """The flags the kernel is compiled with (also by :mod:`.qmatmul_ext`)."""
    return _FLAGS + native_flags(compiler)


def cache_dir() -> Path:
    """Where built kernels are cached: ``$MLX_PARALLM_HOME/kernels``."""
    return cache_home() / "kernels"


def cpu_signature() -> str:
    """What a ``-march=native`` build depends on: the CPU's model and feature flags."""
    text = cpuinfo_text()
    if text is None:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def build(compiler: Optional[str] = None) -> Optional[Path]:
    """Compile the kernel (or find it already built) and return the library's path; None when
    no C compiler is found or compiling fails (logged)."""
    compiler = compiler or c_compiler()
    if shutil.which(compiler) is None:
        logger.info("no C compiler (%s) found: small-batch matmuls keep MLX's ops", compiler)
        return None
    try:
        flags = c_flags(compiler)
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    except OSError as exc:
        logger.info("C compiler %s unusable (%s): small-batch matmuls keep MLX's ops", compiler, exc)
        return None
    key = hashlib.sha256("\0".join([source_text(), " ".join(flags), version, platform.machine(), cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"qmatmul-{key}.so"
    if kernel_cache.verified(target):
        return target
    if not kernel_cache.writable(target.parent):
        return None
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("could not compile %s (small-batch matmuls keep MLX's ops):\n%s", SOURCE.name, result.stderr[-2000:])
            return None
        return kernel_cache.install(built, target)  # atomic, with its record: a loader finds a whole file or none


class Once:
    """A value made on the first :meth:`get` (thread-safe; None, where making it failed, is
    kept too), until :meth:`reset`. Loading a kernel may compile it, so it happens once."""

    def __init__(self, make: Callable[[], Optional[T]]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._made = False
        self._value: Optional[T] = None

    def get(self) -> Optional[T]:
        if self._made:  # the step's hot path (several calls a layer): no lock once made
            return self._value
        with self._lock:
            if not self._made:
                self._value = self._make()
                self._made = True
            return self._value

    def reset(self) -> None:
        with self._lock:
            self._made, self._value = False, None


def _load_library() -> Optional[ctypes.CDLL]:
    try:
        path = build()
        lib = None if path is None else ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("could not build or load the qmatmul kernel (%s): small-batch matmuls keep MLX's ops", exc)
        return None
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    for function in (lib.qmatmul, lib.qmatmul_int8, lib.qmatmul_x16, lib.qgemm_panels):
        function.argtypes = [p, i, i, p, p, p, i, i, i, p, i]
        function.restype = i
    lib.qm_amx.argtypes, lib.qm_amx.restype = [i], i
    lib.qm_int8_tiles.argtypes, lib.qm_int8_tiles.restype = [], i
    add_amx_switch(lib.qm_amx)
    return lib


_library = Once(_load_library)


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel (built on first call), or None where it cannot be built."""
    return _library.get()


def reset() -> None:
    """Forget the loaded kernel and the configured ``kernel_march`` so the next :func:`load`
    builds again, for the environment's settings (tests)."""
    global _march, _amx
    _library.reset()
    with _settings_lock:
        _march = _amx = None


AMX_ENV = DEVICE_SETTINGS["amx"].env
""":attr:`.DeviceConfig.amx`'s variable: ``0``, the int8 path does not use Intel AMX tiles where
the CPU has them."""


def amx(lib: ctypes.CDLL, use: Optional[bool] = None) -> bool:
    """Whether ``lib``'s int8 path multiplies on AMX tiles (``kernels/qmatmul_tiles.h``); with
    ``use``, turn them off or back on first (where the CPU and Linux give them). False where the
    kernel was built without them (no AMX on this CPU, or another ``-march``)."""
    return bool(lib.qm_amx(-1 if use is None else int(use)))


def int8_path(lib: ctypes.CDLL) -> str:
    """How ``lib``'s int8 path multiplies: ``"tiles, AMX"`` / ``"tiles, vpdpbusd"`` (AVX-512
    VNNI, ``kernels/qmatmul_tiles.h``) or ``"lanes"`` (``kernels/qmatmul_int8.h``)."""
    if not lib.qm_int8_tiles():
        return "lanes"
    return "tiles, AMX" if amx(lib) else "tiles, vpdpbusd"


def qmatmul(lib: ctypes.CDLL, x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
            threads: int = 1, int8: int = 0) -> np.ndarray:
    """``x @ W.T`` for ``x`` (M, K) float32 with M <= :data:`MAX_ROWS` and ``W`` (N, K) given
    as MLX's ``quantize`` packs it: ``packed`` (N, K * bits / 8) uint8, ``scales`` and
    ``biases`` (N, K / group_size) float32. Returns (M, N) float32. With ``int8`` (True or 8),
    any M: ``x`` quantized to int8 in blocks of 32 and multiplied by integer dot products; 16:
    quantized to 16 bits (two int8 planes; only where :func:`int8_path` has tiles)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    n = packed.shape[0]
    out = np.empty((rows, n), dtype=np.float32)
    function = lib.qmatmul_x16 if int8 == 16 else lib.qmatmul_int8 if int8 else lib.qmatmul
    status = function(x.ctypes.data, rows, k, packed.ctypes.data, scales.ctypes.data, biases.ctypes.data, n, bits, group_size, out.ctypes.data, threads)
    if status != 0:
        raise ValueError(f"qmatmul: unsupported shape or format (rows={rows}, K={k}, bits={bits}, group_size={group_size})")
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    path = build()
    print(path if path else "no C compiler: small-batch matmuls use MLX's ops")
    sys.exit(0)
