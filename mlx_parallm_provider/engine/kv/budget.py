"""How many KV blocks an engine's pool has: from ``kv_cache_memory_gb`` when set, else
from the free memory of the device that holds it, the GPU's on a GPU (as vLLM sizes its pool
from ``gpu_memory_utilization``)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import mlx.core as mx

from ...errors import InvalidParameterError
from ...models.device import gpu_memory_free
from .disk_tier import check_folder
from .storage import KV_QUANT_GROUP_SIZE, QUANTIZED_KV_BITS, quantized_bytes_per_value
from .support import recurrent_layers

logger = logging.getLogger(__name__)

FREE_MEMORY_FRACTION = 0.5
"""Share of the memory free at start that an unset budget may grow into."""


def available_memory() -> Optional[tuple[int, str]]:
    """Memory the KV pool's arrays may still take, and where that figure comes from: on a GPU
    what MLX can allocate there (:func:`~...models.device.gpu_memory_free`), else
    :func:`host_memory_available`; None when unknown."""
    on_gpu = gpu_memory_free()
    if on_gpu is not None:
        return on_gpu
    host = host_memory_available()
    return None if host is None else (host, "the memory the OS says is available")


def host_memory_available() -> Optional[int]:
    """Memory the OS says is available now (``MemAvailable``; total physical memory where
    there is no /proc), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def pool_blocks(budget_bytes: Optional[int], bytes_per_token: int, block_size: int, max_tokens_wanted: int) -> int:
    """Blocks in the pool (the null block included).

    With a budget, as many as it holds. Without one, enough for ``max_tokens_wanted``
    (every slot at its full context) but no more than :data:`FREE_MEMORY_FRACTION` of the
    memory free (:func:`available_memory`: the GPU's on a GPU); the arrays then grow only as
    blocks are used (:mod:`.storage`)."""
    block_bytes = bytes_per_token * block_size
    if budget_bytes is not None:
        return max(2, budget_bytes // block_bytes + 1)
    wanted = -(-max_tokens_wanted // block_size) + 1
    free = available_memory()
    if free is not None:
        wanted = min(wanted, max(2, int(free[0] * FREE_MEMORY_FRACTION) // block_bytes + 1))
    logger.info(
        "KV pool: %d blocks of %d tokens (%.2f GiB at most, of %s: %s; kv_cache_memory_gb sets it)",
        wanted - 1, block_size, (wanted - 1) * block_bytes / 1024**3,
        "unknown" if free is None else f"{free[0] / 1024**3:.1f} GiB", "no figure" if free is None else free[1],
    )
    return max(2, wanted)


def _shape(model: Any, config: dict[str, Any]) -> tuple[int, int, int]:
    """(attention layers, KV heads, head size) from the model's config (a multimodal wrapper's
    ``text_config`` under it) and, for a hybrid model, its recurrent layers left out."""
    config = {**config.get("text_config", {}), **config}
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config.get("hidden_size", heads) // heads
    layers = config.get("num_hidden_layers", len(getattr(model, "layers", [])) or 1)
    return max(1, layers - len(recurrent_layers(model))), kv_heads, head_dim


def check_kv_settings(model: Any, config: dict[str, Any], engine_config: Any) -> None:
    """Raise :class:`~...errors.InvalidParameterError` where the model's heads cannot take
    ``kv_cache_dtype`` (quantized blocks group a head's values by :data:`.storage.KV_QUANT_GROUP_SIZE`),
    or ``kv_disk_path`` is not a folder this process can write."""
    _, _, head_dim = _shape(model, config)
    kv_cache_dtype = engine_config.kv_cache_dtype
    if engine_config.kv_disk_path is not None:
        check_folder(engine_config.kv_disk_path)
    if kv_cache_dtype in QUANTIZED_KV_BITS and head_dim % KV_QUANT_GROUP_SIZE:
        raise InvalidParameterError("kv_cache_dtype", f"{kv_cache_dtype!r} needs a head size divisible by {KV_QUANT_GROUP_SIZE}; "
                                    f"this model's is {head_dim} (use 'float16')")


def kv_bytes_per_token(model: Any, config: dict[str, Any], kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token takes across all layers (from the model's config; the
    KV's dtype is ``kv_cache_dtype``, or with ``"auto"`` that of the model's embeddings,
    float32 for packed ones, at least 2 bytes; quantized blocks' codes, scales and biases)."""
    layers, kv_heads, head_dim = _shape(model, config)
    weight = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(weight, "weight", None)  # packed-weight embeddings hold none: they compute in float32
    dtype_bytes = weight.dtype.size if weight is not None else 4
    if kv_cache_dtype in QUANTIZED_KV_BITS:
        return int(2 * layers * kv_heads * head_dim * quantized_bytes_per_value(QUANTIZED_KV_BITS[kv_cache_dtype]))
    if kv_cache_dtype != "auto":
        dtype_bytes = getattr(mx, kv_cache_dtype).size
    return 2 * layers * kv_heads * head_dim * max(2, dtype_bytes)
