"""The GPU paged-attention kernels' own body text, run on the CPU.

:class:`KernelLoop` compiles each kernel's body (``paged_kernels.body_for(kernel, "cpu")``)
into a C++ function that loops over the thread indices in the grid, the way a GPU runs one
thread per index: the kernels' threads share nothing, so a loop computes what the GPU does.
It is a :data:`~mlx_parallm_provider.models.paged_kernels.Launch`, so the GPU backend runs
with it on the CPU. :func:`cuda_source` is the whole CUDA kernel as MLX's ``cuda_kernel``
writes it, for :func:`nvrtc_compile` (NVRTC from the ``nvidia-cuda-nvrtc-cu12`` wheel, where
installed) to compile for sm_90.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from mlx_parallm_provider.models.paged_kernels import MASKED, SCORES, VALUES, KernelCall, KernelSource, Layout, body_for

CPU_TYPES = {mx.float32: "float", mx.float16: "_Float16", mx.bfloat16: "parallm_bf16", mx.int32: "int32_t", mx.uint32: "uint32_t"}
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t", mx.uint32: "uint32_t"}


BF16 = (
    "struct parallm_bf16 {\n  uint16_t bits;\n  operator float() const {\n"
    "    uint32_t u = uint32_t(bits) << 16;\n    float f;\n    std::memcpy(&f, &u, sizeof f);\n    return f;\n  }\n};\n"
)
"""bfloat16 for a C++ compiler without one (GCC before 13): its bits, read as float32's upper half."""


def _template_lines(layout: Layout, types: dict) -> str:
    lines = []
    for name, value in layout.template():
        lines.append(f"  using {name} = {types[value]};" if isinstance(value, mx.Dtype) else f"  constexpr int {name} = {value};")
    return "\n".join(lines) + "\n"


def cpu_source(kernel: KernelSource, layout: Layout, input_dtypes: list[mx.Dtype]) -> str:
    """C++ running ``kernel``'s body once per thread index, ``extern "C" run(inputs..., output, threads)``."""
    params = [f"const {CPU_TYPES[t]}* {name}" for name, t in zip(kernel.inputs, input_dtypes)]
    params += [f"float* {name}" for name in kernel.outputs]
    return (
        "#include <cstdint>\n#include <cmath>\n#include <cstring>\n" + BF16
        + f'extern "C" void run({", ".join(params)}, long long threads) {{\n'
        + _template_lines(layout, CPU_TYPES)
        + "  auto thread = [&](long long thread_index) {\n"
        + body_for(kernel, "cpu")
        + "  };\n  for (long long i = 0; i < threads; ++i) thread(i);\n}\n"
    )


def cuda_source(kernel: KernelSource, layout: Layout, input_dtypes: list[mx.Dtype]) -> str:
    """``kernel`` as MLX's ``mx.fast.cuda_kernel`` writes it (``custom_kernel.cpp``'s
    ``build_kernel``), MLX's own device header replaced by the CUDA half-precision headers
    it includes (its cooperative groups need CUDA's C++ library headers, which the bodies do not use)."""
    header = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\ntypedef int int32_t;\ntypedef unsigned int uint32_t;\n"
    params = [f"    const {CUDA_TYPES[t]}* {name}" for name, t in zip(kernel.inputs, input_dtypes)]
    params += [f"    float* {name}" for name in kernel.outputs]
    return (header + "namespace mlx::core::cu {\n\n"
            + f"__global__ void custom_kernel_{kernel.name}(\n" + ",\n".join(params) + ") {\n"
            + _template_lines(layout, CUDA_TYPES) + "\n" + body_for(kernel, "cuda") + "\n}\n\n} // namespace mlx::core::cu\n")


class KernelLoop:
    """A :data:`Launch` running the kernels' text on the CPU (g++, one build per kernel,
    layout and input dtypes, kept under ``directory``)."""

    def __init__(self, directory: Optional[Path] = None) -> None:
        self.directory = Path(directory or tempfile.mkdtemp(prefix="parallm-gpu-emulator-"))
        self._libs: dict[str, ctypes.CDLL] = {}
        self.launches = 0

    @staticmethod
    def available() -> bool:
        return shutil.which("g++") is not None

    def _lib(self, source: str) -> ctypes.CDLL:
        digest = hashlib.blake2b(source.encode(), digest_size=12).hexdigest()
        lib = self._libs.get(digest)
        if lib is None:
            src, out = self.directory / f"{digest}.cpp", self.directory / f"{digest}.so"
            if not out.exists():
                src.write_text(source)
                tmp = out.with_suffix(f".{os.getpid()}.tmp")
                subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True,
                               capture_output=True, text=True)
                os.replace(tmp, out)
            lib = self._libs[digest] = ctypes.CDLL(str(out))
        return lib

    def __call__(self, call: KernelCall) -> mx.array:
        arrays = [np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)) for a in call.inputs]
        dtypes = [a.dtype for a in call.inputs]
        lib = self._lib(cpu_source(call.kernel, call.layout, dtypes))
        out = np.zeros(call.output_shape, dtype=np.float32)
        args = [a.ctypes.data_as(ctypes.c_void_p) for a in arrays] + [out.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(call.threads)]
        lib.run(*args)
        self.launches += 1
        return mx.array(out)


def mlx_ops_launch(call: KernelCall) -> mx.array:
    """A :data:`Launch` giving the float kernels' outputs by MLX's ops on their inputs (the
    whole sum in the first split): nothing is evaluated, so a traced (compiled) step runs
    them on the CPU, as MLX's custom kernels run in one on a GPU."""
    lay = call.layout
    if call.kernel.name not in (SCORES.name, VALUES.name):
        raise NotImplementedError(f"{call.kernel.name}: float pools only")
    H, KVH, BS, W = lay.heads, lay.kv_heads, lay.block_size, lay.window
    G = H // KVH
    if call.kernel.name == SCORES.name:
        queries, pool, table, limits = call.inputs[:4]
        B, _, L, T = call.output_shape
    else:
        probs, pool, table, limits = call.inputs[:4]
        _, B, _, L, _ = call.output_shape
        T = probs.shape[-1]
    end = limits.reshape(B, L)
    start = mx.maximum(end - W, 0) if W else mx.zeros_like(end)
    t = start[..., None] + mx.arange(T)[None, None, :]  # (B, L, T): each score's token
    seen = t < end[..., None]
    t = mx.where(seen, t, 0)
    blocks = mx.take_along_axis(mx.broadcast_to(table[:, None, :], (B, L, table.shape[1])), t // BS, axis=2)
    rows = pool[blocks * BS + t % BS].astype(mx.float32)  # (B, L, T, KVH, D)
    rows = rows.transpose(0, 3, 1, 2, 4)[:, :, None]  # (B, KVH, 1, L, T, D)
    if call.kernel.name == SCORES.name:
        q = queries.reshape(B, KVH, G, L, 1, -1)
        scores = (q * rows).sum(-1) * call.inputs[5]
        return mx.where(seen[:, None, None], scores, MASKED).reshape(B, H, L, T)
    p = (probs.reshape(B, KVH, G, L, T) * seen[:, None, None])[..., None]
    out = (p * rows).sum(-2).reshape(1, B, H, L, -1)
    return mx.concatenate([out, mx.zeros((call.output_shape[0] - 1, *out.shape[1:]), mx.float32)])


def traceable_gpu_backend(**device):
    """The GPU backend as this machine runs it, where a decode step can be traced (compiled):
    MLX's custom kernels on a GPU, else :func:`mlx_ops_launch`; ``device``: its
    :class:`~mlx_parallm_provider.config.DeviceConfig` settings."""
    from mlx_parallm_provider.config import DeviceConfig
    from mlx_parallm_provider.models.backends.gpu_kernels import GPUKernels, MLXKernels
    from mlx_parallm_provider.models.device import gpu_platform

    platform = gpu_platform()
    launch = MLXKernels(platform) if platform is not None else mlx_ops_launch
    return GPUKernels(DeviceConfig(**device), launch=launch, platform=platform or "test")


def nvrtc() -> Optional[tuple[ctypes.CDLL, Path]]:
    """NVRTC and the CUDA headers (``nvidia-cuda-nvrtc-cu12`` and ``nvidia-cuda-runtime-cu12``), or None where not installed."""
    try:
        import nvidia.cuda_nvrtc as nvrtc_pkg
        import nvidia.cuda_runtime as runtime_pkg
    except ImportError:
        return None
    lib_dir = Path(list(nvrtc_pkg.__path__)[0]) / "lib"
    include = Path(list(runtime_pkg.__path__)[0]) / "include"
    libs = sorted(lib_dir.glob("libnvrtc.so*"))
    if not libs or not (include / "cuda_fp16.h").exists():
        return None
    return ctypes.CDLL(str(libs[0])), include


def nvrtc_compile(source: str, arch: str = "compute_90") -> tuple[bool, str, int]:
    """Compile CUDA ``source`` to PTX with NVRTC: (compiled, the log, PTX bytes)."""
    found = nvrtc()
    if found is None:
        raise RuntimeError("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12)")
    lib, include = found
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"parallm.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-I{include}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = ctypes.c_size_t()
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace"), ptx.value
