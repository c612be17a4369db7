"""The CPU attention kernels' Python face: one-token (decode) attention through the MLX
extension's fused kernel (``kernels/decode_attention.cpp``), over mlx-lm's caches or paged KV.

Each function returns None where the kernel does not apply (more than one query position,
head sizes or masks it does not take, no extension), and the caller then uses MLX's ops.
Whether to try them at all is the model's backend's choice
(:class:`.backends.CPUKernels`), as is the number of threads.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import activations as _activations
from mlx_lm.models import base as _base

from ..config import DEVICE_SETTINGS

mlx_lm_attention = _base.scaled_dot_product_attention
"""mlx-lm's attention function (quantized caches and attention sinks still go there)."""
mlx_lm_swiglu = _activations.swiglu

THREADS_ENV = DEVICE_SETTINGS["attention_threads"].env
MAX_THREADS = int(DEVICE_SETTINGS["attention_threads"].limit.maximum)  # more is a typo: the kernel's int would overflow
MAX_HEAD_DIM = 256  # decode_attention.cpp's limits
MAX_GROUP = 16


def default_threads() -> int:
    """The decode kernel's default threads: the CPU count, up to 8."""
    return min(os.cpu_count() or 1, 8)


_builder: Any = None  # .qmatmul_ext, imported on first use: this module loads with the package, the builder need not


def _extension() -> Any:
    global _builder
    if _builder is None:
        from . import qmatmul_ext

        _builder = qmatmul_ext
    return _builder.load()


def takes_heads(queries: mx.array, kv_heads: int) -> bool:
    """Whether the kernels take ``queries`` (B, heads, L, D) over ``kv_heads`` KV heads:
    one position, and heads and D as :func:`_fits_heads` says."""
    _, heads, L, D = queries.shape
    return L == 1 and _fits_heads(heads, D, kv_heads)


def _fits_heads(heads: int, D: int, kv_heads: int) -> bool:
    """D a multiple of 16 up to :data:`MAX_HEAD_DIM`, at most :data:`MAX_GROUP` query heads
    per KV head."""
    return not D % 16 and D <= MAX_HEAD_DIM and not heads % kv_heads and heads // kv_heads <= MAX_GROUP


def _row_mask(mask: Optional[Any], batch: int, keys: int) -> tuple[bool, Optional[mx.array]]:
    """Whether the kernel takes mlx-lm's mask for one query position, and the mask to pass:
    ``(True, mask)`` for one that reshapes to ``(1 or B, S)`` (the kernel reshapes it),
    ``(True, None)`` for no mask, ``(False, None)`` for a form it does not take (a mask per
    head)."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):  # one query sees every key
        return True, None
    if isinstance(mask, str) or mask.shape[-1] != keys or mask.size not in (keys, batch * keys):
        return False, None
    if mask.ndim > 1 and mask.shape[0] != mask.size // keys:
        return False, None
    return True, mask


def decode_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Optional[Any],
    threads: int = 1,
) -> Optional[mx.array]:
    """Attention of one query position per row through the MLX extension's CPU kernel on
    ``threads`` threads, or None where it does not apply (see the module docstring)."""
    if not takes_heads(queries, keys.shape[1]):
        return None
    ok, row_mask = _row_mask(mask, queries.shape[0], keys.shape[2])
    ext = _extension() if ok else None
    if ext is None or not hasattr(ext, "decode_attention"):
        return None
    out = ext.decode_attention(queries, keys, values, scale, row_mask, threads)
    return out.astype(queries.dtype)


def paged_decode_attention(
    queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int, scale: float,
    threads: int = 1, window: Optional[int] = None, scales: Optional[Sequence[mx.array]] = None, bits: int = 0,
) -> Optional[mx.array]:
    """Attention over paged KV through the MLX extension's CPU kernel on ``threads`` threads,
    or None where it does not apply (as :func:`decode_attention`, float32, float16 or
    quantized pools only): the caller then gathers the rows' blocks and uses MLX's ops.

    ``queries`` ``(B, heads, L, D)``; ``k_pool`` / ``v_pool`` ``(slots, kv_heads, D)``;
    ``table`` ``(B, M)`` int32 block ids; ``lengths`` ``(B,)`` int32, each row's tokens (L =
    1; see :mod:`..engine.kv.storage`), or ``(B, L)``: the tokens each query position sees
    (a verify step's positions, each computed as it would be alone, a row's blocks read once
    for all of them); the pools float32, or float16 (widened as the kernel reads them);
    ``window``: each position sees only the last ``window`` of its tokens (a sliding-window
    layer; None: all). Quantized pools (``bits`` 8 or 4): ``k_pool`` / ``v_pool`` are
    ``mx.quantize``'s uint32 codes ``(slots, kv_heads, D * bits / 32)`` (group size
    :data:`QUANT_GROUP`) and ``scales`` ``(key_scales, key_biases, value_scales,
    value_biases)``, float16 ``(slots, kv_heads, D / 32)``, dequantized a tile at a time as
    the kernel reads them."""
    _, heads, L, D = queries.shape
    if not _fits_heads(heads, D, k_pool.shape[1]) or (L > 1 and lengths.ndim != 2) or k_pool.shape != v_pool.shape:
        return None
    if k_pool.dtype != v_pool.dtype:
        return None
    if bits or scales is not None:
        if not _quantized_pools(k_pool, scales, bits, D):
            return None
    elif k_pool.dtype not in (mx.float32, mx.float16):
        return None
    ext = _extension()
    if ext is None or not hasattr(ext, "paged_decode_attention"):
        return None
    if (L > 1 and not getattr(ext, "paged_positions", False)) or (k_pool.dtype == mx.float16 and not getattr(ext, "paged_float16_pools", False)):
        return None
    if window is not None and (not getattr(ext, "paged_windows", False) or window < 1):
        return None
    if bits:
        if not getattr(ext, "paged_quantized_pools", False):
            return None
        out = ext.paged_decode_attention(queries, k_pool, v_pool, table, lengths, block_size, scale, threads, window or 0, list(scales or ()), bits)
    elif window is not None:
        out = ext.paged_decode_attention(queries, k_pool, v_pool, table, lengths, block_size, scale, threads, window)
    else:
        out = ext.paged_decode_attention(queries, k_pool, v_pool, table, lengths, block_size, scale, threads)
    return out.astype(queries.dtype)


QUANT_GROUP = 32
"""Values a scale and bias of the quantized pools the kernel reads (the storage's ``KV_QUANT_GROUP_SIZE``)."""


def _quantized_pools(k_pool: mx.array, scales: Optional[Sequence[mx.array]], bits: int, D: int) -> bool:
    """Whether the kernel reads these quantized pools: uint32 codes of ``bits`` 8 or 4 for
    head size ``D`` (a multiple of :data:`QUANT_GROUP`), four float16 scale / bias arrays of
    one group a :data:`QUANT_GROUP` values."""
    if bits not in (8, 4) or scales is None or len(scales) != 4 or k_pool.dtype != mx.uint32 or D % QUANT_GROUP:
        return False
    if k_pool.shape[2] * 32 != D * bits:
        return False
    shape = (k_pool.shape[0], k_pool.shape[1], D // QUANT_GROUP)
    return all(a.dtype == mx.float16 and a.shape == shape for a in scales)


def has_attention_step() -> bool:
    """Whether the extension has the fused attention step (:func:`paged_attention_step`)."""
    ext = _extension()
    return ext is not None and hasattr(ext, "paged_attention_step")


def fits_step(heads: int, k_pool: mx.array, scales: Optional[Sequence[mx.array]] = None, bits: int = 0) -> bool:
    """Whether :func:`paged_attention_step` takes ``heads`` query heads over ``k_pool``
    ``(slots, kv_heads, D)`` (float32 or float16), or over quantized pools (``bits`` 8 or 4:
    ``k_pool`` the codes, ``scales`` as :func:`paged_decode_attention` takes them) where the
    extension's steps write them."""
    if bits or scales is not None:
        if not scales or not _quantized_pools(k_pool, scales, bits, scales[0].shape[2] * QUANT_GROUP):
            return False
        ext = _extension()
        return getattr(ext, "step_quantized_pools", False) and _fits_heads(heads, scales[0].shape[2] * QUANT_GROUP, k_pool.shape[1])
    return k_pool.dtype in (mx.float32, mx.float16) and _fits_heads(heads, k_pool.shape[2], k_pool.shape[1])


def paged_attention_step(
    queries: mx.array, keys: mx.array, values: mx.array, k_pool: mx.array, v_pool: mx.array, slots: mx.array, table: mx.array,
    limits: mx.array, offset: mx.array, heads: int, rope: Any, block_size: int, scale: float, threads: int = 1,
    scales: Optional[Sequence[mx.array]] = None,
) -> mx.array:
    """The extension's fused step (see :meth:`.backends.MLXOps.paged_attention_step`):
    ``rope`` a :class:`..fused_ops.FusedRoPE` (its ``dims``, ``traditional``, ``scale`` and
    ``inv_freq``). The pools are written in place: the caller orders their later readers
    after the result. ``scales``: quantized pools' (where :func:`fits_step`), written too."""
    return _extension().paged_attention_step(queries, keys, values, k_pool, v_pool, slots, table, limits, offset, rope.inv_freq,
                                             heads, rope.dims, rope.traditional, rope.scale, block_size, scale, threads,
                                             list(scales) if scales else None)


def decoder_layer(x: mx.array, plan: Any, step: tuple[Any, ...], heads: int, rope: Any, scale: float, attention_threads: int,
                  matmul_threads: int, packed_rows: int, int8: int) -> mx.array:
    """The extension's decoder-layer op (``kernels/decoder_layer.cpp``) over ``plan`` (a
    :class:`.backends.layer_step.LayerPlan`) and ``step`` (a paged cache's ``step_inputs()``):
    the pools are written in place, the caller orders their later readers after the result.
    ``int8``: 0 the float kernels, 8 or 16 the integer path's activation bits."""
    k_pool, v_pool, slots, table, limits, offset, block_size, scales = step
    return _extension().decoder_layer(x, plan.w_in, plan.eps_in, plan.w_post, plan.eps_post, list(plan.weights), list(plan.bits),
                                      list(plan.groups), k_pool, v_pool, slots, table, limits, offset, rope.inv_freq, heads,
                                      rope.dims, rope.traditional, rope.scale, block_size, scale, attention_threads,
                                      matmul_threads, packed_rows, int8, plan.qkv_bias, list(scales) if scales else None)
