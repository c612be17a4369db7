"""The backend of this package's CPU kernels: several times faster than MLX's own ops on
the CPU device for attention, SwiGLU, RMSNorm, RoPE and small-batch matmuls.

* attention: one-token (decode) steps through the MLX extension's fused kernel
  (:mod:`..attention`), other steps through :mod:`..cpu_ops`' plain-MLX formulations for all
  but tiny tensors, MLX's ``mx.fast`` below that;
* SwiGLU and the cascade attention's ``exp``: :mod:`..cpu_ops`' arithmetic ``exp``;
* RMSNorm and RoPE (float32): the extension's fused ops, in the modules
  :mod:`..fused_ops` installs;
* sampled rows: their log-softmax (where MLX's CPU exp is scalar), their top-p / min-p / top-k
  filters, their Gumbel-max draw and their top logprobs' tokens, one extension op each for a
  step's rows (MLX's log-softmax, mlx-lm's filters and MLX's draw, many times faster);
* linear layers of a quantized checkpoint: steps of at most :attr:`CPUKernels.packed_rows`
  rows multiply by the packed weights (:mod:`..small_batch`), larger ones by float32 copies;
  with :attr:`CPUKernels.int8_matmul` (the default on CPUs with AVX-512 VNNI), every row count
  by the packed weights with activations quantized to 16 bits or int8 and integer dot products.

Without a compiler (no extension) every method falls back to :class:`.MLXOps`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import mlx.core as mx

from ...config import DEVICE_SETTINGS, DeviceConfig
from .. import attention, cpu_ops, qmatmul, qmatmul_ext
from . import layer_step
from .mlx_ops import MLXOps

ROWS_ENV = DEVICE_SETTINGS["small_batch_rows"].env
QMATMUL_THREADS_ENV = DEVICE_SETTINGS["qmatmul_threads"].env
INT8_MATMUL_ENV = DEVICE_SETTINGS["int8_matmul"].env
"""The variables of :class:`.DeviceConfig`'s fields these backends read (defaults only)."""
MAX_QMATMUL_THREADS = int(DEVICE_SETTINGS["qmatmul_threads"].limit.maximum)  # the kernel's pool: 15 helpers and the caller

logger = logging.getLogger(__name__)


def default_qmatmul_threads() -> int:
    """The packed-weight kernel's default threads: 2 where the machine has two CPUs or more
    (measured on 2 cores; more are untested)."""
    return min(os.cpu_count() or 1, 2)


def int8_tiles() -> bool:
    """Whether this machine's packed-weight kernel has the int8 path over weight tiles
    (``kernels/qmatmul_tiles.h``, built where the CPU has AVX-512 VNNI), which 16-bit
    activations need."""
    ext = qmatmul_ext.load()
    if ext is not None:
        return bool(ext.int8_tiles())
    lib = qmatmul.load()
    return lib is not None and bool(lib.qm_int8_tiles())


def default_int8_setting() -> int:
    """16 (the integer path with 16-bit activations) where the kernel has the tiles
    (:func:`int8_tiles`): their numerics are the float path's (``bench.int8_numerics``) and
    they multiply 1.4-2x faster at 8 rows and more; else 0 (the float kernels)."""
    return 16 if int8_tiles() else 0


def int8_setting(device: Optional[DeviceConfig] = None) -> int:
    """The integer path's activation bits, 0 for the float kernels: ``device.int8_matmul``
    (default :class:`.DeviceConfig`'s), None meaning :func:`default_int8_setting`; 16 without
    the tiles is warned about and replaced by 8."""
    bits = (device or DeviceConfig()).int8_matmul
    if bits is None:
        return default_int8_setting()
    if bits == 16 and not int8_tiles():
        logger.warning("int8_matmul=16: 16-bit activations need the kernel's tiles (AVX-512 VNNI); using int8 activations")
        return 8
    return bits


@dataclass(eq=False)
class CPUKernels(MLXOps):
    """This package's CPU kernels, set from ``device`` (a :class:`.DeviceConfig`, by default
    the environment's), when the backend is made: ``attention_threads`` (the decode kernel),
    ``packed_rows`` (``small_batch_rows``: steps of at most that many rows multiply by the
    packed weights; 0 turns the packed-weight kernel off), ``qmatmul_threads`` (the
    packed-weight kernel; its helper threads take shares of a call's rows as they come free,
    so a busy core slows a call no more than one thread would), ``int8_matmul`` and
    ``activation_bits`` (:func:`int8_setting`: quantized layers multiply every row count with
    activations quantized to ``activation_bits`` and integer dot products) and
    ``float32_weights``. A value given here wins over ``device``'s; they may be changed on a
    model's backend afterwards (tests, profiles)."""

    device: DeviceConfig = field(default_factory=DeviceConfig)
    attention_threads: int = 0  # 0: device.attention_threads, else attention.default_threads()
    packed_rows: int = -1  # type: ignore[assignment]  # -1: device.small_batch_rows
    qmatmul_threads: int = 0  # type: ignore[assignment]  # 0: device.qmatmul_threads, else default_qmatmul_threads()
    int8_matmul: Optional[bool] = None  # type: ignore[assignment]  # None: from int8_setting()
    activation_bits: int = 0  # type: ignore[assignment]  # 0: from int8_setting() (8 where it is off)
    float32_weights: Optional[bool] = None  # type: ignore[assignment]  # None: device.float32_weights
    _plans: dict[int, Optional[layer_step.LayerPlan]] = field(default_factory=dict, repr=False, compare=False)

    name = "cpu"
    kernels = True
    reads_pages = True
    steps_layers = True
    stacks_siblings = False  # (its layers are its own: packed siblings, :mod:`..small_batch`)
    head_sizes = (16, attention.MAX_HEAD_DIM, attention.MAX_GROUP)

    def __post_init__(self) -> None:
        device = self.device
        if not self.attention_threads:
            self.attention_threads = device.attention_threads or attention.default_threads()
        if self.packed_rows < 0:
            self.packed_rows = device.small_batch_rows
        if not self.qmatmul_threads:
            self.qmatmul_threads = device.qmatmul_threads or default_qmatmul_threads()
        if self.float32_weights is None:
            self.float32_weights = device.float32_weights
        if self.int8_matmul is None or not self.activation_bits:
            setting = int8_setting(device)
            if self.int8_matmul is None:
                self.int8_matmul = setting > 0
            if not self.activation_bits:
                self.activation_bits = setting or 8

    def attention_path(self) -> str:
        if not attention.has_attention_step():
            return "gather (the CPU kernels' extension is not built)"
        return "CPU kernel through the block tables"

    def dense_attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any],
                        sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
        if sinks is not None or softcap is not None:  # (the kernels and cpu_ops' formulation take neither)
            return super().dense_attention(queries, keys, values, scale, mask, sinks, softcap)
        out = self.decode_attention(queries, keys, values, scale, mask)
        if out is not None:
            return out
        if cpu_ops.attention_size(queries, keys) >= cpu_ops.MIN_ELEMENTS:
            return cpu_ops.attention(queries, keys, values, scale, mask)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def decode_attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any]) -> Optional[mx.array]:
        return attention.decode_attention(queries, keys, values, scale, mask, self.attention_threads)

    def paged_decode_attention(
        self, queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int, scale: float,
        window: Optional[int] = None, scales: Optional[Sequence[mx.array]] = None, bits: int = 0,
        sinks: Optional[mx.array] = None, softcap: Optional[float] = None,
    ) -> Optional[mx.array]:
        if sinks is not None or softcap is not None:  # (the CPU kernel takes neither: gathered)
            return None
        return attention.paged_decode_attention(queries, k_pool, v_pool, table, lengths, block_size, scale, self.attention_threads,
                                                window, scales, bits)

    def steps_attention(self, rope: Any) -> bool:
        return getattr(rope, "inv_freq", None) is not None and attention.has_attention_step()

    def fits_attention_step(self, heads: int, k_pool: mx.array, scales: Optional[Sequence[mx.array]], bits: int) -> bool:
        return attention.fits_step(heads, k_pool, scales, bits)

    def paged_attention_step(self, queries: mx.array, keys: mx.array, values: mx.array, k_pool: mx.array, v_pool: mx.array,
                             slots: mx.array, table: mx.array, limits: mx.array, offset: mx.array, heads: int, rope: Any,
                             block_size: int, scale: float, scales: Optional[Sequence[mx.array]] = None) -> mx.array:
        return attention.paged_attention_step(queries, keys, values, k_pool, v_pool, slots, table, limits, offset, heads, rope,
                                              block_size, scale, self.attention_threads, scales)

    def layer_step(self, block: Any, x: mx.array, cache: Any) -> Optional[mx.array]:
        rows = x.shape[0] * x.shape[1] if x.ndim == 3 else 0
        if not 0 < rows <= layer_step.MAX_ROWS or not 0 < self.packed_rows <= qmatmul.MAX_ROWS:
            return None
        can = getattr(cache, "can_attend_step", None)
        if can is None or x.dtype != mx.float32:
            return None
        if id(block) not in self._plans:  # (the backend belongs to one model: its blocks live as long)
            self._plans[id(block)] = layer_step.plan_of(block)
        plan, attn = self._plans[id(block)], block.self_attn
        if plan is None or not self.steps_attention(attn.rope) or not can(attn.n_heads, x.shape[1], self):
            return None
        if plan.copies and rows > self.packed_rows and not self.int8_matmul:
            return None  # (those rows multiply by the float32 copies, through OpenBLAS)
        out = attention.decoder_layer(x, plan, cache.step_inputs(), attn.n_heads, attn.rope, attn.scale, self.attention_threads,
                                      self.qmatmul_threads, self.packed_rows, self.activation_bits if self.int8_matmul else 0)
        cache.wrote(out, ragged=True)
        return out

    def log_softmax(self, rows: mx.array) -> Optional[mx.array]:
        ext = _fused()
        # (MLX's CPU runs 8 floats a SIMD step on macOS, so it adds its exps in another order there)
        if not hasattr(ext, "log_softmax") or sys.platform == "darwin" or rows.dtype != mx.float32 or rows.ndim != 2:
            return None
        return ext.log_softmax(rows, self.qmatmul_threads)

    def top_tokens(self, rows: mx.array, k: int) -> Optional[mx.array]:
        ext = _fused()
        if not hasattr(ext, "top_tokens") or rows.dtype != mx.float32 or rows.ndim != 2 or not 1 <= k <= rows.shape[1]:
            return None
        return ext.top_tokens(rows, k, self.qmatmul_threads)

    def filter_rows(self, logprobs: mx.array, top_p: Sequence[float], min_p: Sequence[float], top_k: Sequence[int]) -> Optional[mx.array]:
        ext = _fused()
        if not hasattr(ext, "filter_rows") or logprobs.dtype != mx.float32 or logprobs.ndim != 2:
            return None
        # (top_p and log(min_p) as float32, as mlx-lm's float32 arithmetic takes them)
        params = mx.array([[p, math.log(m) if m > 0.0 else -math.inf, k] for p, m, k in zip(top_p, min_p, top_k)], dtype=mx.float32)
        return ext.filter_rows(logprobs, params, self.qmatmul_threads)

    def gumbel_draw(self, rows: mx.array, keys: mx.array) -> Optional[mx.array]:
        ext = _fused()
        if not hasattr(ext, "gumbel_draw") or rows.dtype != mx.float32 or rows.ndim != 2 or keys.dtype != mx.uint32:
            return None
        return ext.gumbel_draw(rows, keys, self.qmatmul_threads)  # MLX's noise, bit for bit: the tokens MLX's draw gives

    def exp(self, x: mx.array) -> mx.array:
        return cpu_ops.fast_exp(x)

    def swiglu(self, gate: mx.array, x: mx.array) -> mx.array:
        ext = _fused()
        if hasattr(ext, "swiglu") and gate.dtype == mx.float32 and x.dtype == mx.float32 and gate.shape == x.shape:
            return ext.swiglu(gate, x)  # one op at every size: batched rows compute as a row alone does
        if gate.size >= cpu_ops.MIN_ELEMENTS:
            return cpu_ops.swiglu(gate, x)
        return super().swiglu(gate, x)

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array:
        ext = _fused()
        if ext is None or x.dtype != mx.float32 or x.ndim == 0:
            return super().rms_norm(x, weight, eps)
        return ext.rms_norm(x, weight, eps)

    def rope(self, x: mx.array, dims: int, traditional: bool, base: float, scale: float, offset: Union[int, mx.array], freqs: Any) -> mx.array:
        ext = _fused()
        if ext is None or freqs is None or x.dtype != mx.float32 or x.ndim < 3:
            return super().rope(x, dims, traditional, base, scale, offset, freqs)
        if isinstance(offset, mx.array):
            if offset.ndim > 1 or offset.size not in (1, x.shape[0]) or not mx.issubdtype(offset.dtype, mx.integer):
                return super().rope(x, dims, traditional, base, scale, offset, freqs)
        elif isinstance(offset, int):
            offset = mx.array(offset, dtype=mx.int32)
        else:
            return super().rope(x, dims, traditional, base, scale, offset, freqs)
        return ext.rope(x, dims, traditional, scale, offset, freqs)

    def adapt_quantized(self, model: Any) -> None:
        """Keep the packed weights for small steps and fuse RMSNorm / RoPE (CPU device only;
        nothing without a compiler)."""
        from .. import fused_ops, small_batch
        from ..device import is_cpu

        if is_cpu():
            small_batch.dequantize(model, self)
            fused_ops.install(model, self)


def _fused() -> Any:
    """The extension where it builds with the fused norm and RoPE ops (and SwiGLU, the draws), else None."""
    ext = attention._extension()
    return ext if ext is not None and hasattr(ext, "rope") else None
