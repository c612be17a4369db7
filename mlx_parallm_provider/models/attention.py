"""Attention routed by the KV cache that holds the keys.

mlx-lm's model files compute attention with ``scaled_dot_product_attention(queries, keys,
values, cache=cache, scale=..., mask=...)``, a name each model module imports from
``mlx_lm.models.base``. :func:`install` points that name, in the loaded model's module, at
:func:`attend`, which lets the cache decide: a cache with an ``attend(queries, keys, values,
scale=..., mask=...)`` method computes attention itself (a shared prefix held once);
a quantized cache gets mlx-lm's own function; every other cache gets :func:`dense_attention`,
plain attention over the keys the cache returned (the one place to choose a faster
formulation for a device).

On the CPU device, :func:`dense_attention` and the model's SwiGLU (where its module uses
mlx-lm's ``swiglu``) run :mod:`.cpu_ops`' formulations for all but tiny tensors, several
times faster there, and one-token (decode) attention runs :func:`decode_attention`, the MLX
extension's fused kernel (``kernels/decode_attention.cpp``, on
``MLX_PARALLM_ATTENTION_THREADS`` threads, default the CPU count up to 8) where that
extension builds; Metal and CUDA keep MLX's fused kernels. ``MLX_PARALLM_CPU_OPS=0`` (or
:func:`set_cpu_ops`) turns them off, ``=1`` forces them on any device.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import activations as _activations
from mlx_lm.models import base as _base

from .._validation import env_int
from . import cpu_ops
from .backend import is_cpu

mlx_lm_attention = _base.scaled_dot_product_attention
"""mlx-lm's function, which :func:`attend` falls back to."""
mlx_lm_swiglu = _activations.swiglu

CPU_OPS_ENV = "MLX_PARALLM_CPU_OPS"
THREADS_ENV = "MLX_PARALLM_ATTENTION_THREADS"
MAX_THREADS = 256  # more is a typo: the kernel's int would overflow, every step would fail
MAX_HEAD_DIM = 256  # decode_attention.cpp's limits
MAX_GROUP = 16
_cpu_ops: Optional[bool] = None  # None: MLX_PARALLM_CPU_OPS, else the CPU device only


def set_cpu_ops(enabled: Optional[bool]) -> None:
    """Use :mod:`.cpu_ops` always (True), never (False), or by default (None:
    ``MLX_PARALLM_CPU_OPS`` if set, else on the CPU device only)."""
    global _cpu_ops
    _cpu_ops = enabled


def uses_cpu_ops() -> bool:
    """Whether attention and SwiGLU run :mod:`.cpu_ops`' formulations now."""
    if _cpu_ops is not None:
        return _cpu_ops
    value = os.environ.get(CPU_OPS_ENV, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    return is_cpu()


def _extension() -> Any:
    from . import qmatmul_ext  # here, not at the top: this module loads with the package, the extension's builder need not

    return qmatmul_ext.load()


@functools.cache
def _threads() -> int:
    """The decode kernel's threads (``MLX_PARALLM_ATTENTION_THREADS``, default the CPU count up
    to 8, bounded to 1..:data:`MAX_THREADS` with a warning), read once."""
    return env_int(THREADS_ENV, min(os.cpu_count() or 1, 8), 1, MAX_THREADS)


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
    prefix_index: Optional[mx.array] = None,
    prefixes: Sequence[tuple[mx.array, mx.array]] = (),
) -> Optional[mx.array]:
    """Attention of one query position per row through the MLX extension's CPU kernel, or
    None where it does not apply (not one position, :func:`uses_cpu_ops` off, no extension,
    head sizes or mask it does not take): the caller then uses MLX's ops.

    ``prefix_index`` (B,) int32 and ``prefixes`` (``(keys, values)`` of ``(1, kv_heads, P, D)``
    each): row ``b`` attends to ``prefixes[prefix_index[b]]`` (none where -1) before its own
    ``keys`` (see :mod:`..engine.shared_kv`); ``mask`` applies to its own keys only."""
    B, heads, L, D = queries.shape
    kv_heads = keys.shape[1]
    if L != 1 or D % 16 or D > MAX_HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP or not uses_cpu_ops():
        return None
    ok, row_mask = _row_mask(mask, B, keys.shape[2])
    ext = _extension() if ok else None
    if ext is None or not hasattr(ext, "decode_attention"):
        return None
    out = ext.decode_attention(queries, keys, values, scale, row_mask, prefix_index, list(prefixes), _threads())
    return out.astype(queries.dtype)


def paged_decode_attention(
    queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int, scale: float
) -> Optional[mx.array]:
    """Attention of one query position per row over paged KV through the MLX extension's
    CPU kernel, or None where it does not apply (as :func:`decode_attention`, and float32
    pools only): the caller then gathers the rows' blocks and uses MLX's ops.

    ``k_pool`` / ``v_pool`` ``(slots, kv_heads, D)``; ``table`` ``(B, M)`` int32 block ids;
    ``lengths`` ``(B,)`` int32, each row's tokens (see :mod:`..engine.kv.storage`)."""
    B, heads, L, D = queries.shape
    kv_heads = k_pool.shape[1]
    if L != 1 or D % 16 or D > MAX_HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP or not uses_cpu_ops():
        return None
    if k_pool.dtype != mx.float32 or v_pool.dtype != mx.float32 or k_pool.shape != v_pool.shape:
        return None
    ext = _extension()
    if ext is None or not hasattr(ext, "paged_decode_attention"):
        return None
    out = ext.paged_decode_attention(queries, k_pool, v_pool, table, lengths, block_size, scale, _threads())
    return out.astype(queries.dtype)


def dense_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any]) -> mx.array:
    """Plain attention: ``queries`` (B, heads, L, D) over ``keys`` / ``values`` (B, kv_heads,
    S, D), ``mask`` as mlx-lm passes it (None, ``"causal"`` or an array)."""
    out = decode_attention(queries, keys, values, scale, mask)
    if out is not None:
        return out
    if uses_cpu_ops() and cpu_ops.attention_size(queries, keys) >= cpu_ops.MIN_ELEMENTS:
        return cpu_ops.attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``: :func:`.cpu_ops.swiglu` where :func:`uses_cpu_ops`, else mlx-lm's."""
    if uses_cpu_ops() and gate.size >= cpu_ops.MIN_ELEMENTS:
        return cpu_ops.swiglu(gate, x)
    return mlx_lm_swiglu(gate, x)


def attend(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Optional[Any], sinks: Optional[Any] = None) -> Any:
    """``scaled_dot_product_attention`` with the same signature as mlx-lm's, delegating to
    ``cache.attend`` where the cache has one, to mlx-lm for quantized caches and attention
    sinks, and to :func:`dense_attention` otherwise."""
    if sinks is not None or hasattr(cache, "bits"):
        return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    own = getattr(cache, "attend", None)
    if own is not None:
        return own(queries, keys, values, scale=scale, mask=mask)
    return dense_attention(queries, keys, values, scale=scale, mask=mask)


def install(model: Any) -> bool:
    """Route ``model``'s attention through :func:`attend` (and its module's mlx-lm
    ``swiglu``, if it uses one, through :func:`swiglu`). Returns whether its module calls
    mlx-lm's attention function by that name (if not, the model is left alone and caches'
    ``attend`` methods are never used, which is correct, only slower)."""
    module = sys.modules.get(type(model).__module__)
    if getattr(module, "swiglu", None) is mlx_lm_swiglu:
        module.swiglu = swiglu  # type: ignore[union-attr]
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is attend:
        return True
    if current is not mlx_lm_attention:
        return False
    module.scaled_dot_product_attention = attend  # type: ignore[union-attr]
    return True
