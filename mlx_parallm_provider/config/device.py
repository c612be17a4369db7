""":class:`DeviceConfig`: how one engine computes on its device, each field's default from its variable."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping, Optional

from .._validation import Limit
from ..errors import InvalidParameterError
from .environment import MARCH_PATTERN
from .settings import CheckedSettings, Setting, parse_blas, parse_choice, parse_int8, parse_march, parse_word, setting_field

PAGED_ATTENTION = ("auto", "kernel", "gather")
"""How a GPU attends over paged KV (:attr:`DeviceConfig.paged_attention`)."""


DEVICE_SETTINGS: dict[str, Setting] = {
    "cpu_kernels": Setting(Limit("bool", optional=True), "MLX_PARALLM_CPU_OPS", None, parse_choice),
    "blas": Setting(Limit("text", words="'auto' / 'off' / a library path"), "MLX_PARALLM_BLAS", "auto", parse_blas),
    "small_batch_rows": Setting(Limit("int", 0, 64), "MLX_PARALLM_SMALL_BATCH_ROWS", 4),
    "qmatmul_threads": Setting(Limit("int", 1, 16, optional=True), "MLX_PARALLM_QMATMUL_THREADS"),
    "attention_threads": Setting(Limit("int", 1, 256, optional=True), "MLX_PARALLM_ATTENTION_THREADS"),
    "int8_matmul": Setting(Limit("choice", choices=(0, 8, 16), optional=True), "MLX_PARALLM_INT8_MATMUL", None, parse_int8),
    "float32_weights": Setting(Limit("bool"), "MLX_PARALLM_FLOAT32_WEIGHTS", False, parse_choice),
    "kernel_march": Setting(Limit("text", optional=True, pattern=MARCH_PATTERN, words="an -march name (e.g. 'x86-64-v3') / None"),
                            "MLX_PARALLM_KERNEL_MARCH", None, parse_march),
    "amx": Setting(Limit("bool"), "MLX_PARALLM_AMX", True, parse_choice),
    "paged_attention": Setting(Limit("choice", choices=PAGED_ATTENTION), "MLX_PARALLM_PAGED_ATTENTION", "auto", parse_word),
    "compile_decode": Setting(Limit("bool", optional=True), "MLX_PARALLM_COMPILE_DECODE", None, parse_choice),
    "stack_projections": Setting(Limit("bool"), "MLX_PARALLM_STACK_PROJECTIONS", True, parse_choice),
}
""":class:`DeviceConfig`'s fields: limits, variables, built-in defaults."""


def _field(name: str) -> Any:
    return setting_field(DEVICE_SETTINGS, name)


@dataclass(frozen=True)
class DeviceConfig(CheckedSettings):
    """How one engine computes on its device (the CPU kernels and their knobs).

    Every field's default comes from its environment variable (listed in
    ``docs/configuration.md``) where set, else the built-in default; an explicit value wins.
    Most are the engine's own, so two engines of one process may differ; ``blas``,
    ``kernel_march`` and ``amx`` are per process, as noted.

    Attributes:
        cpu_kernels: whether the model runs on this package's CPU kernels (fused attention,
            RMSNorm, RoPE, SwiGLU, small-batch matmuls over the packed weights) instead of
            MLX's own ops. None: on the CPU device only.
        blas: the BLAS MLX's CPU matmuls use: ``"auto"`` (the system OpenBLAS), ``"off"``
            (MLX's bundled reference BLAS) or a library path. Per process: the library is
            loaded globally once, before this package first imports mlx (with the process
            default, this field's variable); an engine asking for another is warned about.
            Where mlx was imported first, each engine's model binds it privately.
        small_batch_rows: steps of at most this many rows multiply quantized layers by their
            packed weights through the C kernel (wider steps through the panel GEMM or
            float32 copies); 0 turns the packed-weight kernel off.
        qmatmul_threads: threads of the packed-weight kernel (its helpers take shares of a
            call's rows as they come free). None: 2 where the machine has two CPUs or more.
        attention_threads: threads of the decode-attention kernel. None: the CPU count, up to 8.
        int8_matmul: quantized layers multiply every row count by integer dot products, with
            activations quantized in blocks of 32 to 16 bits (16: the float path's numerics,
            needs AVX-512 VNNI; on a CPU without it 8 is used) or 8 bits (8: llama.cpp's
            numerics); 0: the float kernels. None: 16 where the kernel has its AVX-512 VNNI
            tiles, else 0.
        float32_weights: quantized layers also keep a float32 copy of their weights for large
            steps (OpenBLAS's GEMM over it) instead of dequantizing tiles of the packed
            weights as they go; more memory.
        kernel_march: the ``-march`` the C kernels and the MLX extension are built with
            instead of ``native``: a lesser ISA of this CPU (e.g. ``x86-64-v3``) to run and
            measure that path; one this CPU cannot run is warned about and ignored. Per
            process: the kernels are built and loaded once, for the first engine's value.
        amx: the int8 path multiplies on Intel AMX tiles where the CPU and Linux give them;
            False keeps them off. Per process: the loaded kernel's state, set by each engine
            that loads a model (the last one wins).
        paged_attention: on a GPU (Metal, CUDA), how attention reads the paged KV:
            ``"kernel"``, this package's kernels read it through the block tables;
            ``"gather"``, each row's blocks are copied into a rectangle for MLX's attention;
            ``"auto"``, the kernels where their check at first use passes, else the gather.
        compile_decode: a decode step's forward pass runs as one compiled MLX function
            (``mx.compile``, one trace per padded row count and block-table width), so the
            host replays its graph instead of building it in Python each step. None: where
            the GPU's paged kernels take every layer's attention (no sliding windows; rows
            with a LoRA adapter step uncompiled); True: tried wherever the pass allows;
            False: never.
        stack_projections: where MLX's ops compute the model (a GPU, or ``cpu_kernels``
            False), each llama / qwen2 layer's q/k/v and gate/up projections, quantized
            alike, are stacked at load and multiplied as one product each (as vLLM's merged
            linear layers), the layers keeping views of the stacked weights (no more memory):
            the same outputs, fewer and wider launches. Rows with a LoRA adapter multiply
            layer by layer. False: each layer its own product.
    """

    _SETTINGS: ClassVar[dict[str, Setting]] = DEVICE_SETTINGS
    cpu_kernels: Optional[bool] = _field("cpu_kernels")
    blas: str = _field("blas")
    small_batch_rows: int = _field("small_batch_rows")
    qmatmul_threads: Optional[int] = _field("qmatmul_threads")
    attention_threads: Optional[int] = _field("attention_threads")
    int8_matmul: Optional[int] = _field("int8_matmul")
    float32_weights: bool = _field("float32_weights")
    kernel_march: Optional[str] = _field("kernel_march")
    amx: bool = _field("amx")
    paged_attention: str = _field("paged_attention")
    compile_decode: Optional[bool] = _field("compile_decode")
    stack_projections: bool = _field("stack_projections")

    @classmethod
    def from_env(cls, **overrides: Any) -> "DeviceConfig":
        """The environment's defaults, ``overrides`` replacing them (the same as ``DeviceConfig(**overrides)``)."""
        return cls(**overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "device") -> "DeviceConfig":
        """A config from a mapping of field names (a JSON object), unknown names refused."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidParameterError(where, f"has unknown DeviceConfig fields {unknown}")
        return cls(**values)


def default_blas() -> str:
    """The process's BLAS choice before any engine exists (:attr:`DeviceConfig.blas`'s default)."""
    return DEVICE_SETTINGS["blas"].from_env("blas")
