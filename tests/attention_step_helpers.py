"""Helpers for the fused attention step's tests (the CPU's and the GPU backend's): a tiny
model's KV prefilled into paged storage, and one step run fused and then apart."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_parallm_provider.engine.kv import KVCacheManager
from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch
from mlx_parallm_provider.engine.kv.storage import PagedKVStorage


def copy_storage(storage: PagedKVStorage) -> PagedKVStorage:
    """A storage with its own copies of ``storage``'s arrays (the fused step writes in place)."""
    twin = PagedKVStorage(storage.num_layers, storage.num_blocks, storage.block_size, dtype=storage.dtype, bits=storage.bits)
    twin._blocks, twin.compute_dtype = storage.physical_blocks, storage.compute_dtype
    twin.keys = [_own(a) for a in storage.keys]
    twin.values = [_own(a) for a in storage.values]
    if storage.bits:
        twin.scales = [[_own(a) for a in layer] for layer in storage.scales]
    return twin


def _own(a: mx.array) -> mx.array:
    """A copy of ``a`` in memory of its own (through numpy, which has no bfloat16: as its bits)."""
    if a.dtype == mx.bfloat16:
        return mx.array(np.array(a.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(a))


def prefilled(model, prompts, block_size, dtype, bits=None):
    """``prompts`` through ``model`` into a new paged storage of ``dtype`` (``bits``: quantized)
    pools, each row with blocks for 4 more tokens; the block manager and the storage."""
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    storage = PagedKVStorage(len(model.layers), kv.pool.num_blocks, block_size, dtype=dtype, bits=bits)
    for b, prompt in enumerate(prompts):
        kv.grow(b, len(prompt) + 4)
    storage.reserve(kv.pool.high_water())
    batch = PagedBatch(storage, [kv.table(b) for b in range(len(prompts))], [0] * len(prompts), [len(p) for p in prompts],
                       max(map(len, prompts)))
    width = max(map(len, prompts))
    mx.eval(model(mx.array([p + [0] * (width - len(p)) for p in prompts]), cache=batch.layers()))
    mx.eval(storage.arrays())
    return kv, storage


def fused_then_apart(model, dtype, width: int, turn_off, bits=None) -> None:
    """A step of three rows (3 + 17 + 40 tokens held; ``width`` new ones a row at most) with
    the fused ops, then, ``turn_off()`` called, the same step over a copy of the KV: the same
    logits and the same KV written, bit for bit."""
    prompts = [list(range(7, 7 + n)) for n in (3, 17, 40)]
    kv, storage = prefilled(model, prompts, 4, dtype, bits)
    new = [[11 + i for i in range(max(1, width - b))] for b in range(len(prompts))]  # rows of up to `width` tokens
    tokens = mx.array([row + [0] * (width - len(row)) for row in new])
    for b, prompt in enumerate(prompts):
        kv.grow(b, len(prompt) + width)
    storage.reserve(kv.pool.high_water())

    def step(store: PagedKVStorage) -> mx.array:
        batch = PagedBatch(store, [kv.table(b) for b in range(len(prompts))], [len(p) for p in prompts],
                           [len(row) for row in new], width)
        logits = model(tokens, cache=batch.layers())
        mx.eval(logits, store.arrays())
        return logits

    apart = copy_storage(storage)
    fused = step(storage)
    turn_off()
    separate = step(apart)
    for b, row in enumerate(new):
        assert mx.array_equal(fused[b, : len(row)], separate[b, : len(row)]).item(), b
    # (The null block, slots [0, 4), takes padding's writes and is never read: the layer op
    # writes its padding as its row's last real token, the separate ops as the pad token.)
    # (Quantized pools: the codes, scales and biases the step writes are mx.quantize's.)
    assert len(storage.arrays()) == len(apart.arrays()) == len(model.layers) * (6 if bits else 2)
    for mine, theirs in zip(storage.arrays(), apart.arrays()):
        assert mine.dtype == theirs.dtype and mx.array_equal(mine[4:], theirs[4:]).item()
