"""The KV block pool and block tables: pure bookkeeping."""

from __future__ import annotations

import pytest

from mlx_parallm_provider.engine.kv import BlockPool, KVCacheManager, blocks_for


def test_null_block_is_never_handed_out_and_lowest_ids_go_first():
    pool = BlockPool(5)
    assert pool.num_usable == 4 and pool.num_free == 4
    assert pool.allocate(2) == [1, 2]
    pool.release([1])
    assert pool.allocate(1) == [1]
    assert pool.high_water() == 3
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_shared_block_is_free_only_when_every_holder_released_it():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.share([b])
    pool.release([b])
    assert pool.num_free == 1 and pool.refs(b) == 1
    pool.release([b])
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        pool.release([b])


def test_tables_grow_by_blocks_and_free_returns_them():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    assert kv.capacity_tokens == 32 and blocks_for(9, 4) == 3
    kv.grow("a", 5)
    assert kv.table("a") == [1, 2] and kv.held_tokens("a") == 8
    kv.grow("a", 8)  # still fits in two blocks
    assert kv.table("a") == [1, 2]
    kv.grow("b", 1)
    kv.grow("a", 9)
    assert kv.table("a") == [1, 2, 4] and kv.table("b") == [3]
    assert kv.can_hold({"a": 12, "c": 16}) and not kv.can_hold({"a": 13, "c": 17})
    assert kv.free("a") == 3
    assert kv.stats()["kv_blocks_used"] == 1
    kv.preempted("b")
    assert kv.stats() == {
        "kv_block_size": 4, "kv_blocks_total": 8, "kv_blocks_free": 8, "kv_blocks_used": 0,
        "kv_cache_usage_perc": 0.0, "num_preemptions": 1,
    }


def test_growing_past_the_pool_raises_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.grow("a", 3)
    with pytest.raises(ValueError):
        kv.grow("b", 1)
    assert kv.table("b") == [] and kv.stats()["kv_blocks_free"] == 0
    assert kv.fits_alone(4) and not kv.fits_alone(5)
