"""The KV storage's writes touch the slots they write and nothing else of the pools: MLX
writes an array in place only where nothing else reads it in the same graph, else it copies
the whole array first. A copy of every layer's pools to write a few blocks costs a large
pool's whole size in memory and time (a GPU's pool: gigabytes), so these tests watch MLX's
peak memory. No CPU kernel: scripts/gpu_check.sh runs these on a GPU."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine_helpers import peak_memory_above_now
from mlx_parallm_provider.engine.kv.storage import PagedKVStorage

pytestmark = pytest.mark.gpu

BLOCKS, BLOCK_SIZE = 8192, 16


def _filled(dtype, bits) -> tuple[PagedKVStorage, mx.array, mx.array]:
    """2 layers of pools of ~8 MiB an array (float32), blocks 1 and 2 written."""
    storage = PagedKVStorage(2, num_blocks=BLOCKS, block_size=BLOCK_SIZE, preallocate=True, dtype=dtype, bits=bits)
    keys, values = mx.random.normal((32, 2, 64), key=mx.random.key(1)), mx.random.normal((32, 2, 64), key=mx.random.key(2))
    for layer in range(2):
        storage.write(layer, mx.arange(16, 48, dtype=mx.int32), keys, values)
    mx.eval(storage.arrays())
    return storage, keys, values


@pytest.mark.parametrize("dtype, bits", [(mx.float32, None), (None, 8)])
def test_copy_on_write_copies_the_blocks_without_copying_the_pools(dtype, bits) -> None:
    storage, _, _ = _filled(dtype, bits)
    smallest = min(a.nbytes for a in storage.arrays() if a.shape[0] == BLOCKS * BLOCK_SIZE)
    before = [storage.read(layer, mx.arange(16, 48, dtype=mx.int32)) for layer in range(2)]
    mx.eval(before)  # (unevaluated, these reads would hold the pools as they were)

    def copy() -> None:
        storage.copy_blocks([(1, 7), (2, 9)])
        mx.eval(storage.arrays())

    assert peak_memory_above_now(copy) < smallest / 4  # (a pool copied whole: at least one array's size)
    for layer in range(2):
        k, v = storage.read(layer, mx.array([7 * 16 + i for i in range(16)] + [9 * 16 + i for i in range(16)], dtype=mx.int32))
        assert mx.array_equal(k, before[layer][0]).item() and mx.array_equal(v, before[layer][1]).item()


def test_writes_go_into_the_pools_in_place() -> None:
    storage, keys, values = _filled(mx.float32, None)

    def write() -> None:
        storage.write(0, mx.arange(200, 232, dtype=mx.int32), keys * 2, values * 2)
        mx.eval(storage.arrays())

    assert peak_memory_above_now(write) < storage.arrays()[0].nbytes / 4
    k, _ = storage.read(0, mx.arange(200, 232, dtype=mx.int32))
    assert mx.array_equal(k, keys * 2).item()
