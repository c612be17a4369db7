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
    assert kv.table("a") == [1, 2]
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
        "kv_cache_usage_perc": 0.0, "num_preemptions": 1, "kv_blocks_cached": 0, "prefix_evictions": 0,
    }


def test_growing_past_the_pool_raises_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.grow("a", 3)
    with pytest.raises(ValueError):
        kv.grow("b", 1)
    assert kv.table("b") == [] and kv.stats()["kv_blocks_free"] == 0
    assert kv.fits_request(3, 4) and not kv.fits_request(3, 5)


def test_a_prompt_shares_the_cached_blocks_of_the_longest_prefix_in_whole_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = list(range(100, 111))  # 11 tokens: two full blocks and 3
    kv.grow("a", len(first))
    assert kv.register("a", first, len(first)) == 3  # two whole, one holding 3 tokens
    a_blocks = kv.table("a")
    # Same first 9 tokens: the two full blocks, never the token that must be recomputed.
    second = first[:9] + [7, 7, 7]
    hit = kv.match(second, len(second) - 1)
    assert hit.blocks == a_blocks[:2] and hit.copy_from == a_blocks[2] and hit.copy_tokens == 1 and hit.tokens == 9
    assert kv.match(second, 7).blocks == a_blocks[:1]  # at most 7 tokens: one whole block
    assert kv.match(second, 7).copy_from == a_blocks[1] and kv.match(second, 7).tokens == 7  # + 3 of the next
    assert kv.match([1] + first, 20).tokens == 0  # the same tokens at other positions are another prefix
    kv.grow("b", len(second), prefix=hit)
    table = kv.table("b")
    assert table[:2] == a_blocks[:2] and kv.pool.refs(a_blocks[0]) == 2
    assert table[2] not in a_blocks and kv.pending_copies == [(a_blocks[2], table[2])]
    assert kv.pool.refs(a_blocks[2]) == 2  # its source is held until copied
    assert kv.copied() == [(a_blocks[2], table[2])] and kv.pool.refs(a_blocks[2]) == 1 and not kv.pending_copies


def test_cached_blocks_outlive_their_request_until_the_pool_needs_them():
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable blocks
    tokens = [1, 2, 3, 4, 5]
    kv.grow("a", 5)
    kv.register("a", tokens, 4)  # two whole blocks
    kv.free("a")
    assert kv.stats()["kv_blocks_free"] == 4 and kv.stats()["kv_blocks_cached"] == 2
    assert len(kv.match(tokens, 4).blocks) == 2  # still found after its request ended
    kv.grow("b", 6)  # the two free blocks, then the least recently used cached one: the second
    assert kv.match(tokens, 4).blocks == kv.match(tokens, 2).blocks and kv.pool.evictions == 1
    kv.grow("c", 2)
    assert kv.match(tokens, 4).tokens == 0 and kv.pool.evictions == 2


def test_the_cache_names_at_most_max_cached_blocks():
    kv = KVCacheManager(num_blocks=9, block_size=2, max_cached_blocks=2)
    kv.grow("a", 6)
    assert kv.register("a", [1, 2, 3, 4, 5, 6], 6) == 2  # the third would pass the bound: all held
    kv.grow("z", 2)
    assert kv.register("z", [9, 8], 1) == 0  # a partial block too
    kv.free("a")
    kv.grow("b", 2)
    assert kv.register("b", [9, 9], 2) == 1  # an idle one makes room
    assert kv.stats()["kv_blocks_cached"] == 2


def test_a_partly_filled_block_is_renamed_when_it_fills_up():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [5, 6, 7, 8, 9, 10]
    kv.grow("a", 6)
    assert kv.register("a", tokens, 5) == 2  # one whole block, one with 1 token
    assert kv.match(tokens + [1, 1], 7).tokens == 5
    assert kv.register("a", tokens, 6) == 1  # the second now holds 2 of them
    assert kv.match(tokens + [1, 1], 7).tokens == 6 and kv.stats()["kv_blocks_cached"] == 2


def test_cached_blocks_are_reused_before_the_arrays_grow_once_the_store_is_full():
    kv = KVCacheManager(num_blocks=20, block_size=2, max_cached_blocks=3)
    kv.pool.physical = 4  # the arrays hold blocks 0..3
    kv.grow("a", 6)  # blocks 1, 2, 3
    kv.register("a", [1, 2, 3, 4, 5, 6], 6)  # the store is full: 3 blocks named
    kv.free("a")
    idle = list(kv.pool._idle)  # least recently used first
    kv.grow("b", 4)  # the least recently used cached block first; then the store has room again
    assert kv.table("b") == [idle[0], 4] and kv.pool.evictions == 1 and kv.pool.high_water() == 5
    kv.grow("c", 4)  # the arrays grow: the store keeps its other two blocks
    assert kv.table("c") == [5, 6] and kv.pool.evictions == 1 and kv.pool.num_cached == 2


def test_the_arrays_grow_for_new_kv_while_the_store_has_room():
    # A store below its budget keeps its prefixes: new KV goes past the arrays (they grow),
    # so two prompts taking turns each find their own prefix again.
    kv = KVCacheManager(num_blocks=20, block_size=2, max_cached_blocks=8)
    kv.pool.physical = 4
    first, second = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    kv.grow("a", 6)
    kv.register("a", first, 6)
    kv.free("a")
    kv.grow("b", 6)
    assert kv.table("b") == [4, 5, 6] and kv.pool.evictions == 0 and kv.pool.high_water() == 7
    kv.register("b", second, 6)
    kv.free("b")
    assert kv.match(first + [0], 7).tokens == 6 and kv.match(second + [0], 7).tokens == 6


def test_admission_counts_the_idle_cached_blocks_it_takes_and_the_copy_source():
    kv = KVCacheManager(num_blocks=8, block_size=4)  # 7 usable
    tokens = list(range(10, 20))  # two whole blocks and 2 tokens
    kv.grow("a", 10)
    kv.register("a", tokens, 10)
    kv.free("a")  # all three cached, held by nobody
    hit = kv.match(tokens + [1, 2, 3, 4, 5, 6], 11)
    assert hit.tokens == 10 and len(hit.blocks) == 2 and hit.copy_from is not None
    # 16 tokens: 4 blocks; 2 shared (idle: taken from the free count), 1 source held, 2 new.
    assert kv.admission_cost(16, hit) == 5 == kv.pool.num_free - 2
    before = kv.pool.num_free
    kv.grow("b", 16, hit)
    assert before - kv.pool.num_free == 5
    kv.copied()
    assert before - kv.pool.num_free == 4  # the copy's source is let go


def test_blocks_to_come_counts_what_each_table_may_still_add_up_to_its_limit():
    kv = KVCacheManager(num_blocks=40, block_size=4)
    kv.grow("a", 9, limit=20)  # 3 blocks now, 5 at most
    kv.grow("b", 4, limit=4)  # full already
    kv.grow("c", 2)  # no limit given: counts nothing
    assert kv.blocks_to_come() == 2
    kv.grow("a", 17)
    assert kv.blocks_to_come() == 0
    kv.fit("a", 30)  # past its limit (speculative drafts): never negative
    assert kv.blocks_to_come() == 0
    kv.free("a")
    kv.grow("d", 1, limit=40)
    assert kv.blocks_to_come() == 9
    kv.preempted("d")  # its limit goes with its blocks
    assert kv.blocks_to_come() == 0


def test_slide_releases_the_blocks_no_later_query_can_see_and_keeps_positions():
    kv = KVCacheManager(num_blocks=20, block_size=4, window=6)
    kv.grow("a", 17)  # 5 blocks: tokens 0-3, 4-7, 8-11, 12-15, 16
    first = list(kv.table("a"))
    assert kv.slide("a", 9) == 1  # a query at 9 sees 4..9: block 0 goes
    assert kv.table("a") == [0, *first[1:]] and kv.stats()["kv_blocks_used"] == 4
    assert kv.slide("a", 9) == 0  # already gone
    assert kv.slide("a", 16) == 1  # sees 11..16: block 1 (4-7) goes, block 2 (8-11) holds 11
    assert kv.table("a") == [0, 0, *first[2:]]
    kv.grow("a", 21)  # positions keep their place: the next block is entry 5
    assert len(kv.table("a")) == 6 and kv.stats()["kv_blocks_used"] == 4
    kv.register("a", list(range(21)), 21)  # released entries are not named
    assert kv.stats()["kv_blocks_cached"] == 4
    assert kv.free("a") == 4 and kv.stats()["kv_blocks_used"] == 0
    assert KVCacheManager(num_blocks=20, block_size=4).slide("x", 100) == 0  # no window: nothing
    # at most: a window and the blocks it straddles, or the prompt, or everything when shorter
    assert kv.peak_blocks(10, 500) == 4 and kv.peak_blocks(40, 500) == 11 and kv.peak_blocks(3, 9) == 3


def test_hold_gives_every_owner_its_entries_or_changes_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable blocks
    kv.grow("a", 4)
    kv.grow("b", 8)
    assert kv.hold({"a": 8, "b": 5})  # a grows to 2 blocks, b is cut to 2 (fit)
    assert (len(kv.table("a")), len(kv.table("b")), kv.pool.num_free) == (2, 2, 1)
    assert not kv.hold({"a": 12, "b": 12})  # 2 more wanted, 1 free
    assert (len(kv.table("a")), len(kv.table("b")), kv.pool.num_free) == (2, 2, 1)


GIB = 1024**3


@pytest.mark.parametrize("platform, info, held, expected_free", [
    # CUDA: the device's own free memory, plus what MLX's cache holds for reuse (not the host's)
    ("cuda", {"device_name": "NVIDIA H200", "free_memory": 100 * GIB, "total_memory": 140 * GIB}, {"cache": 4 * GIB}, 104 * GIB),
    # Metal: the working set Metal recommends, less what MLX's arrays hold (the weights)
    ("metal", {"max_recommended_working_set_size": 24 * GIB, "memory_size": 32 * GIB}, {"active": 6 * GIB}, 18 * GIB),
])
def test_on_a_gpu_an_unset_kv_budget_is_sized_from_the_gpus_free_memory(monkeypatch, platform, info, held, expected_free):
    import mlx.core as mx

    from mlx_parallm_provider.engine.kv import budget
    from mlx_parallm_provider.models import device

    monkeypatch.setattr(device, "gpu_platform", lambda: platform)
    monkeypatch.setattr(mx, "device_info", lambda *a: dict(info))
    monkeypatch.setattr(mx, "get_cache_memory", lambda: held.get("cache", 0))
    monkeypatch.setattr(mx, "get_active_memory", lambda: held.get("active", 0))
    monkeypatch.setattr(budget, "host_memory_available", lambda: 1000 * GIB)  # a big host: not what the GPU has
    free, source = budget.available_memory()
    assert free == expected_free and ("CUDA" in source if platform == "cuda" else "Metal" in source)
    block_bytes = 1024 * 16  # 1 KiB a token, 16-token blocks
    wanted = 10**9  # every slot at a long context: more than any memory
    assert budget.pool_blocks(None, 1024, 16, wanted) == int(expected_free * budget.FREE_MEMORY_FRACTION) // block_bytes + 1
    assert budget.pool_blocks(None, 1024, 16, 16 * 40) == 41  # room for what is wanted, where that is less
    assert budget.pool_blocks(2 * GIB, 1024, 16, wanted) == 2 * GIB // block_bytes + 1  # a budget given wins


def test_off_a_gpu_an_unset_kv_budget_is_sized_from_the_hosts_available_memory(monkeypatch):
    from mlx_parallm_provider.engine.kv import budget

    monkeypatch.setattr(budget, "gpu_memory_free", lambda: None)
    monkeypatch.setattr(budget, "host_memory_available", lambda: 8 * GIB)
    assert budget.available_memory() == (8 * GIB, "the memory the OS says is available")
    assert budget.pool_blocks(None, 1024, 16, 10**9) == int(8 * GIB * budget.FREE_MEMORY_FRACTION) // (1024 * 16) + 1
    monkeypatch.setattr(budget, "host_memory_available", lambda: None)
    assert budget.available_memory() is None
    assert budget.pool_blocks(None, 1024, 16, 16 * 40) == 41  # no figure: what is wanted
