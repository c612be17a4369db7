"""``mlx-parallm doctor``: what this process would run models on, and why it may be slow.

Prints the device, the BLAS MLX's matmuls bind to (and whether dense layers go through a
privately bound OpenBLAS because mlx was imported first), the CPU's vector features, the
kernels built and in use, the model cache, the device settings an engine made now would get
(:class:`.DeviceConfig`, from the environment), the model pool's budget, the models and LoRA
adapters this process has loaded (:mod:`.engine.pool`), and the versions of what matters.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import sys
from typing import Any

from . import __version__
from .config import DeviceConfig, EngineConfig, PoolConfig, c_compiler, cache_home
from .cpu_info import cpu_model_name
from .errors import InvalidParameterError

#: Vector features that decide which kernels a CPU gets (x86 flags, ARM features).
VECTOR_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                   "avx512_bf16", "amx_tile", "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")

PACKAGES = ("mlx", "mlx-lm", "mlx-parallm-provider", "litellm", "langchain-core", "llguidance", "transformers",
            "tokenizers", "nanobind")


def cpu_features() -> list[str]:
    """The CPU's vector features among :data:`VECTOR_FEATURES` (from /proc/cpuinfo)."""
    from .models.qmatmul import cpu_flags

    flags = cpu_flags()
    return [f for f in VECTOR_FEATURES if f in flags]


def device_config() -> tuple[DeviceConfig, str]:
    """The device settings an engine made without a config would get, and where they come from."""
    try:
        return EngineConfig.from_env().device, "environment"
    except InvalidParameterError as error:
        return DeviceConfig(), f"environment, MLX_PARALLM_ENGINE_CONFIG ignored ({error})"


def _march(qmatmul: Any) -> str:
    """The ``-march`` the kernels are built with (:attr:`.DeviceConfig.kernel_march` or native)."""
    compiler = c_compiler()
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    return " ".join(qmatmul.native_flags(compiler)) or "no -march (generic)"


def _int8(qmatmul: Any, device: DeviceConfig) -> str:
    """The int8 path's kernel here, and whether it is on (:attr:`.DeviceConfig.int8_matmul`)."""
    from .models.backends.cpu_kernels import INT8_MATMUL_ENV, int8_setting

    lib = qmatmul.load()
    if lib is None:
        return "unavailable"
    bits = int8_setting(device)
    return f"{qmatmul.int8_path(lib)}; {f'on, {bits}-bit activations' if bits else 'off'} ({INT8_MATMUL_ENV})"


def pool_report() -> dict[str, str]:
    """The model pool's budget and idle unload, and each model this process loaded (name,
    state, bytes); none where no engine was made (``mlx-parallm doctor`` is a process of its own)."""
    pool = sys.modules.get("mlx_parallm_provider.engine.pool")
    stats = pool.pool_stats() if pool is not None else None
    config = PoolConfig() if stats is None else None
    budget = stats["budget_bytes"] if stats is not None else config.memory_bytes  # type: ignore[union-attr]
    idle = stats["idle_unload_s"] if stats is not None else config.idle_unload_s  # type: ignore[union-attr]
    models = (stats or {}).get("models", {})
    loaded = "; ".join(f"{name} ({m['state']}, {m['bytes'] / 1024**2:.1f} MiB)" for name, m in models.items())
    adapters = "; ".join(f"{engine.model_name}: {_adapters(engine.list_loras())}" for engine in (pool._pool.list_engines() if pool else ())
                         if engine.list_loras()["registered"] or engine.list_loras()["resident"])
    return {
        "model pool budget": f"{budget / 1024**3:.2f} GiB" if budget is not None else "none (MLX_PARALLM_POOL_MEMORY_GB)",
        "model pool idle unload": f"after {idle:g} s" if idle is not None else "never (MLX_PARALLM_POOL_IDLE_UNLOAD_S)",
        "models loaded in this process": loaded or "none",
        "LoRA adapters in this process": adapters or "none",
    }


def _adapters(lora: dict[str, Any]) -> str:
    """An engine's adapters: registered names, then the adapters resident (slot, rank)."""
    names = ", ".join(lora["registered"]) or "no names registered"
    resident = ", ".join(f"{r['path']} (slot {r['slot']}, rank {r['rank']})" for r in lora["resident"]) or "none resident"
    return f"{names}; {resident} of max_loras={lora['max_loras']}"


def device_name() -> str:
    """MLX's default device and what it is (``mx.device_info``: the GPU's or CPU's name)."""
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # an MLX without it, or a device that gives none
        info = {}
    name = info.get("device_name") or info.get("name")
    return f"{mx.default_device()}" + (f" ({name})" if name else "")


def kv_memory() -> str:
    """The memory an engine's KV pool may grow into, unless ``kv_cache_memory_gb`` says."""
    from .engine.kv.budget import FREE_MEMORY_FRACTION, available_memory

    free = available_memory()
    if free is None:
        return "unknown: set kv_cache_memory_gb"
    return f"{FREE_MEMORY_FRACTION:.0%} of {free[0] / 1024**3:.1f} GiB, {free[1]} (kv_cache_memory_gb sets it)"


def _cuda_headers() -> dict[str, str]:
    """On a CUDA GPU, the CUDA headers MLX compiles kernels against (none: why the kernels fail)."""
    from .models.device import cuda_headers, gpu_platform

    if gpu_platform() != "cuda":
        return {}
    found = cuda_headers()
    return {"CUDA headers": str(found) if found is not None else
            "none found: MLX cannot compile kernels; pip install nvidia-cuda-runtime-cu12 (CUDA 12) or set CUDA_HOME"}


def _attention(device: Any) -> dict[str, str]:
    """The backend a model loaded now gets, and how its attention reads the paged KV: on a
    GPU the paged kernels are compiled and checked here, as an engine does at first use."""
    from .models import backends

    chosen = backends.choose(None, device)
    if isinstance(chosen, backends.GPUKernels):
        chosen.kernels_ready()
    return {"backend": f"{chosen.name} ({type(chosen).__name__})", "paged attention": chosen.attention_path()}


def report() -> dict[str, Any]:
    """Everything :func:`main` prints, as a dict."""
    from .models import backend, private_blas, qmatmul, qmatmul_ext  # (first: the BLAS before mlx)

    device, source = device_config()
    qmatmul.configure(device)
    ext = qmatmul_ext.load() if backend.is_cpu() else None
    mlx_first = private_blas.needed(device.blas)
    cache = cache_home()
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["mlx-parallm-provider"] = __version__  # the code running, installed or not (a checkout on PYTHONPATH)
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": device_name(),
        **_cuda_headers(),
        **_attention(device),
        "KV pool at most": kv_memory(),
        "blas": backend.blas_in_use(),
        "blas chosen": backend.chosen_blas(device.blas) or "none (blas='off', or none found)",
        "dense layers": ("OpenBLAS bound privately (mlx was imported first)" if mlx_first and ext is not None
                         else "MLX's reference BLAS: import mlx_parallm_provider before mlx" if mlx_first
                         else "MLX's matmul, over the BLAS above"),
        "cpu": cpu_model_name(with_machine=True),
        "cpu vector features": " ".join(cpu_features()) or "unknown",
        "kernel cache": str(qmatmul.cache_dir()),
        "kernels built with": _march(qmatmul),
        "mlx extension (fused ops, decode attention, small-batch matmul)": "built and loaded" if ext is not None
        else ("not used off the CPU" if not backend.is_cpu() else "unavailable: MLX's ops are used (needs a C++ compiler and nanobind)"),
        "small-batch C kernel (ctypes)": "built" if backend.is_cpu() and qmatmul.load() is not None else "unavailable",
        "int8 matmul": _int8(qmatmul, device) if backend.is_cpu() else "not used off the CPU",
        "model cache": str(cache),
        "device settings from": source,
        **{f"device.{k}": "auto" if v is None else str(v) for k, v in device.as_dict().items()},
        **pool_report(),
        **{f"version {k}": v for k, v in versions.items()},
    }


def main() -> int:
    """Print :func:`report` as aligned lines; returns 0."""
    lines = report()
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"{key:<{width}}  {value}")
    return 0
