""":mod:`.qmatmul`'s kernel as an MLX primitive, so a decode step stays one lazy graph.

Through ctypes every kernel call first evaluates its input: a synchronisation of MLX's CPU
stream (~60 us), made ~120 times a step by a 30-layer model. ``kernels/qmatmul_ext.cpp`` wraps
the same C function in an ``mlx::core::Primitive`` (CPU only) that MLX schedules like its own
ops. The same module holds RMSNorm and RoPE as single CPU ops (``kernels/norm_rope.cpp``,
used by :mod:`.fused_ops`), SwiGLU (``kernels/swiglu.cpp``) and the sampled rows' draws
(``kernels/sampling.cpp``), both used by the CPU backend. It is a C++ extension bound with nanobind,
compiled on first use with ``$CXX`` (else ``c++``; its sources side by side, one a CPU)
against the installed MLX and cached next to the C kernel, keyed by sources, flags,
compiler, MLX version and CPU, and checked before loading (:mod:`.kernel_cache`);
``scripts/setup.sh`` builds it at install.

nanobind must share MLX's internals ABI (the ``nanobind>=3,<4`` that MLX 0.32 is built with),
or ``mx.array`` arguments do not convert: :func:`load` checks one call and returns None when
it fails, as it does without nanobind, a C++ compiler, or on any build failure; callers then
keep the ctypes path. ``python -m mlx_parallm_provider.models.qmatmul_ext`` builds it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Optional

import mlx.core as mx

from ..config import c_compiler, cxx_compiler
from . import kernel_cache, qmatmul

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "qmatmul_ext.cpp"
#: C++ sources of the module: the binding and matmul primitive, RMSNorm / RoPE (:mod:`.fused_ops`), SwiGLU,
#: decode attention and the fused attention step (:mod:`.attention`), the privately bound BLAS
#: (:mod:`.private_blas`), the decoder-layer op (:mod:`.backends.layer_step`), the LoRA update (:mod:`.lora.layers`) and
#: the sampled rows' Gumbel-max draws (:meth:`.backends.CPUKernels.gumbel_draw`).
SOURCES = (SOURCE, SOURCE.with_name("norm_rope.cpp"), SOURCE.with_name("swiglu.cpp"), SOURCE.with_name("decode_attention.cpp"),
           SOURCE.with_name("blas_matmul.cpp"),
           SOURCE.with_name("decoder_layer.cpp"), SOURCE.with_name("lora_update.cpp"), SOURCE.with_name("sampling.cpp"))
HEADERS = tuple(SOURCE.with_name(name) for name in ("cpu_primitive.h", "fast_exp.h", "rope.h", "attention_step.h", "lane_sums.h"))
"""What the primitives share; part of the cache key."""
MODULE = "mlx_parallm_qmatmul_ext"  # NB_MODULE's name in the source
_CXX_FLAGS = ["-std=c++20", "-O3", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx"]


def _mlx_dir() -> Path:
    return Path(mx.__file__).resolve().parent


def _commands(compiler: str, cc: str, scratch: Path, output: Path) -> Optional[tuple[list[list[str]], list[str]]]:
    """One compile command a source (the C kernel first), then the link command; None
    without nanobind."""
    try:
        import nanobind
    except ImportError:
        return None
    nb, mlx_dir = Path(nanobind.source_dir()).parent, _mlx_dir()
    includes = [sysconfig.get_paths()["include"], nb / "include", nb / "ext" / "robin_map" / "include", mlx_dir / "include"]
    cxx = [compiler, *_CXX_FLAGS, *qmatmul.native_flags(compiler), *[f"-I{p}" for p in includes]]
    sources = [*SOURCES, nb / "src" / "nb_combined.cpp"]
    objects = [scratch / f"{i}-{source.stem}.o" for i, source in enumerate([qmatmul.SOURCE, *sources])]
    compiles = [[cc, *qmatmul.c_flags(cc), "-c", str(qmatmul.SOURCE), "-o", str(objects[0])]]
    compiles += [[*cxx, "-c", str(source), "-o", str(obj)] for source, obj in zip(sources, objects[1:])]
    lib = mlx_dir / "lib"
    link = [compiler, "-shared", *map(str, objects), f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}", "-pthread", "-o", str(output)]
    return compiles, link


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        return subprocess.CompletedProcess(command, 1, "", str(exc))


def _compile_all(commands: list[list[str]]) -> Optional[subprocess.CompletedProcess]:
    """Run the compile commands side by side, one a CPU; the first that failed, or None."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max(1, min(cpus, len(commands)))) as pool:
        results = list(pool.map(_run, commands))
    return next((result for result in results if result.returncode != 0), None)


def build(compiler: Optional[str] = None) -> Optional[Path]:
    """Compile the extension (or find it built) and return its path; None when a compiler or
    nanobind is missing or the build fails (logged)."""
    compiler = compiler or cxx_compiler()
    cc = c_compiler()
    if shutil.which(compiler) is None or shutil.which(cc) is None:
        logger.info("no C/C++ compiler (%s, %s): small-batch matmuls keep the ctypes kernel", cc, compiler)
        return None
    with tempfile.TemporaryDirectory() as scratch:
        built = Path(scratch) / "ext.so"
        try:
            commands = _commands(compiler, cc, Path(scratch), built)
            if commands is None:
                logger.info("nanobind is not installed: small-batch matmuls keep the ctypes kernel")
                return None
            versions = [subprocess.run([c, "--version"], capture_output=True, text=True).stdout for c in (cc, compiler)]
        except OSError as exc:
            logger.info("compiler unusable (%s): small-batch matmuls keep the ctypes kernel", exc)
            return None
        import nanobind

        compiles, link = commands
        parts = [*(s.read_text() for s in (*SOURCES, *HEADERS)), qmatmul.source_text(), *_CXX_FLAGS, *compiles[0][1:-4], *versions,
                 mx.__version__, str(_mlx_dir()), nanobind.__version__, platform.machine(), qmatmul.cpu_signature()]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
        target = qmatmul.cache_dir() / f"qmatmul_ext-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
        if kernel_cache.verified(target):
            return target
        if not kernel_cache.writable(target.parent):
            return None
        failed = _compile_all(compiles)
        if failed is None:
            failed = _run(link)
            failed = failed if failed.returncode != 0 else None
        if failed is not None:
            logger.warning("could not build %s (small-batch matmuls keep the ctypes kernel):\n%s", SOURCE.name, failed.stderr[-2000:])
            return None
        return kernel_cache.install(built, target)  # atomic, with its record: a loader finds a whole file or none


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _works(module: ModuleType) -> bool:
    """One call converts ``mx.array`` arguments (nanobind ABIs match) and is right."""
    w = mx.full((1, 4), 0x11111111, dtype=mx.uint32)  # 32 weights of 1
    one = mx.ones((1, 1))
    try:
        return mx.allclose(module.qmatmul(mx.ones((1, 32)), w, one, one * 0, 4, 32), mx.array([[32.0]])).item()
    except (TypeError, RuntimeError, ValueError) as exc:
        logger.warning("the built %s does not work with this MLX (%s): small-batch matmuls keep the ctypes kernel", MODULE, exc)
        return False


def _load_module() -> Optional[ModuleType]:
    try:
        path = build()
        if path is None:
            return None
        module = _import(path)
    except (ImportError, OSError) as exc:
        logger.warning("could not build or load %s (%s): small-batch matmuls keep the ctypes kernel", MODULE, exc)
        return None
    if not _works(module):
        return None
    if hasattr(module, "amx"):
        qmatmul.add_amx_switch(module.amx)
    return module


_module = qmatmul.Once(_load_module)


def load() -> Optional[ModuleType]:
    """The extension module (built on first call), or None where it cannot be built or used."""
    return _module.get()


def reset() -> None:
    """Forget the loaded extension so the next :func:`load` builds again (tests)."""
    _module.reset()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    path = build()
    print(path if path else "the MLX extension could not be built: small-batch matmuls use the ctypes kernel")
    sys.exit(0)
