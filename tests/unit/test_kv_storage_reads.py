"""The KV storage's two reads: ``read`` (token by token, ``(..., kv_heads, D)``) and
``read_heads`` (head by head, ``(..., kv_heads, S, D)``, what attention over gathered blocks
takes) give the same values, for float and quantized blocks, a pass's ``(B, S)`` slots and a
prefix's ``(S,)``."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_parallm_provider.engine.kv.storage import PagedKVStorage


@pytest.mark.parametrize("dtype, bits", [(mx.float32, None), (mx.float16, None), (None, 8), (None, 4)])
def test_reading_head_by_head_gives_the_tokens_values_with_heads_first(dtype, bits) -> None:
    storage = PagedKVStorage(2, num_blocks=12, block_size=4, preallocate=True, dtype=dtype, bits=bits)
    keys, values = mx.random.normal((40, 3, 64), key=mx.random.key(1)), mx.random.normal((40, 3, 64), key=mx.random.key(2))
    storage.write(1, mx.arange(4, 44, dtype=mx.int32), keys, values)
    for slots in (mx.array([[9, 10, 11, 4, 5, 6], [40, 41, 42, 43, 20, 7]], dtype=mx.int32), mx.array([30, 12, 13, 5], dtype=mx.int32)):
        k, v = storage.read(1, slots)  # (*slots, kv_heads, D)
        hk, hv = storage.read_heads(1, slots)  # (..., kv_heads, S, D)
        assert hk.shape == (*slots.shape[:-1], 3, slots.shape[-1], 64) and hk.dtype == k.dtype
        assert mx.array_equal(hk, k.swapaxes(-2, -3)).item() and mx.array_equal(hv, v.swapaxes(-2, -3)).item()
    if bits is None:  # (quantized reads are checked against what was written in test_quantized_kv)
        hk, _ = storage.read_heads(1, mx.array([[4, 5]], dtype=mx.int32))
        assert mx.array_equal(hk[0], keys[:2].astype(dtype).astype(hk.dtype).swapaxes(0, 1)).item()  # (as stored, read in the model's dtype)
