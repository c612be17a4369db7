"""Layers grouped by window, and block tables per group: a window group's blocks past its
window go back to the pool while the global group keeps every token's."""

from __future__ import annotations

import pytest

from mlx_parallm_provider.engine.kv import KVCacheManager
from mlx_parallm_provider.engine.kv.block_pool import NULL_BLOCK
from mlx_parallm_provider.engine.kv.groups import MAX_GROUPS, LayerGroups


def test_layers_alike_make_one_group_and_mixed_ones_groups_of_the_rarest_kinds_count() -> None:
    assert LayerGroups.of([None] * 4) == LayerGroups((None,), ((0, 0), (0, 1), (0, 2), (0, 3)), 4)
    assert LayerGroups.of([32] * 3).windows == (32,)
    gemma3 = [512] * 5 + [None]  # gemma3 270M: five local layers to one global, three times
    groups = LayerGroups.of(gemma3 * 3)
    assert groups.size == 3 and groups.windows == (512,) * 5 + (None,)
    assert [groups.places[layer] for layer in (0, 1, 2, 3, 4, 6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [groups.places[layer] for layer in (5, 11, 17)] == [(5, 0), (5, 1), (5, 2)]
    assert len(set(groups.places)) == 18  # every layer its own (group, slot)
    uneven = LayerGroups.of([8, 8, 8, None, None])  # 3 local, 2 global: the second local group has a spare slot
    assert uneven.size == 2 and uneven.windows == (8, 8, None) and uneven.places[2] == (1, 0)
    many = LayerGroups.of([8] * (MAX_GROUPS + 1) + [None])  # one global layer: too many groups, one table
    assert many.count == 1 and many.windows == (None,)


def test_each_group_holds_its_own_table_and_a_window_group_releases_what_left_its_window() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, windows=[8, None])
    kv.grow("a", 30, limit=40)  # 8 blocks in each group
    assert len(kv.table("a", 0)) == len(kv.table("a", 1)) == 8 and kv.stats()["kv_blocks_used"] == 16
    assert set(kv.table("a", 0)).isdisjoint(kv.table("a", 1))
    assert kv.slide("a", 29) == 5  # a query at 29 sees 22..29: blocks 0-4 of the window group go
    assert kv.table("a", 0)[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in kv.table("a", 1)
    assert kv.blocks_to_grow("a", 33) == 2  # one more entry in each table
    assert kv.blocks_to_come() == 2 + 1  # global: to 10 blocks; window: at most 3 + 1 live
    assert kv.free("a") == 11 and kv.stats()["kv_blocks_used"] == 0
    # Peak: the global group's whole length, the window group's window (and straddled blocks).
    assert kv.peak_blocks(10, 400) == 100 + 4 and kv.fits_request(10, 200) and not kv.fits_request(10, 240)
    assert kv.capacity_tokens == 63 * 4 // 2


def test_a_prefix_hit_maps_every_groups_blocks_and_needs_only_the_window_of_a_window_group() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, windows=[8, None])
    tokens = list(range(100, 132))  # 8 blocks
    kv.grow("a", 32)
    kv.register("a", tokens, 32)
    kv.slide("a", 31)  # the window group's first blocks go back (named: cached, held by nobody)
    kv.free("a")
    hit = kv.match(tokens + [1, 2], 33)
    assert hit.tokens == 32 and hit.of(1) == kv.match(tokens, 32).of(1) and len(hit.of(0)) == 8
    assert hit.of(0)[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in hit.of(0)[6:]  # positions 24..31: blocks 6, 7
    assert kv.admission_cost(35, hit) == 2 * 9 - 8 - 8 + 2 + 8  # its own blocks after the hit; the cached ones it revives
    kv.grow("b", 35, hit)
    assert kv.table("b", 0)[6:8] == hit.of(0)[6:] and kv.table("b", 1)[:8] == hit.of(1)
    kv.free("b")
    # Evict the window group's last cached block: the hit stops where its window is still whole.
    kv.pool._idle.pop(hit.of(0)[7])
    kv.pool._forget(hit.of(0)[7])
    shorter = kv.match(tokens + [1, 2], 33)
    assert shorter.tokens < 32 and all(b != NULL_BLOCK for b in shorter.of(1))


def test_a_chunked_prompt_gets_window_blocks_chunk_by_chunk_and_full_ones_at_admission() -> None:
    from mlx_parallm_provider.engine.request import Request, ResultSink, SamplingParams
    from mlx_parallm_provider.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=200, block_size=4, windows=[8, None])
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=16, kv=kv)
    long = Request("long", list(range(100)), SamplingParams(max_tokens=4), ResultSink())
    s.add(long)
    live = lambda: sum(b != NULL_BLOCK for b in kv.table(id(long), 0))  # noqa: E731
    plan = s.schedule()
    assert plan.chunk == (long, 16)
    assert len(kv.table(id(long), 1)) == 26 and live() == 5  # global: the whole prompt (+1); window: its first chunk (+1)
    most = 0
    while s.chunking is not None:
        s.advanced(long, plan.chunk[1])
        if long.num_prefilled >= long.num_tokens:
            s.started([long])
            break
        plan = s.schedule()
        most = max(most, live())
    # Each chunk: the window before it and the chunk itself, never the prompt so far.
    assert most <= (8 + 16) // 4 + 2 and kv.stats()["kv_blocks_used"] <= 26 + most


def test_running_out_of_blocks_in_a_later_group_gives_back_what_the_earlier_ones_took() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, windows=[8, None])  # 9 usable blocks
    kv.grow("a", 16)  # 4 + 4
    with pytest.raises(ValueError):
        kv.grow("b", 8)  # 2 + 2 wanted, 1 free: the first group's block must go back
    assert kv.stats()["kv_blocks_free"] == 1 and kv.table("b", 0) == kv.table("b", 1) == []
    with pytest.raises(ValueError):
        kv.grow("a", 24)  # an existing owner: its tables keep what they had
    assert len(kv.table("a", 0)) == len(kv.table("a", 1)) == 4 and kv.stats()["kv_blocks_free"] == 1


def test_a_failed_admission_with_a_cached_prefix_undoes_its_shares_and_its_copy() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=4)  # one group: the partly shared block is copied
    tokens = list(range(50, 60))
    kv.grow("a", 10)
    kv.register("a", tokens, 10)
    kv.free("a")  # 3 blocks cached, idle
    hit = kv.match(tokens[:9] + [1, 2], 10)
    assert hit.copy_from is not None and len(hit.blocks) == 2
    before = kv.stats()
    with pytest.raises(ValueError):
        kv.grow("b", 60, hit)  # 15 blocks: more than the pool
    assert kv.pending_copies == [] and kv.stats() == before and kv.table("b") == []
    assert kv.match(tokens[:9] + [1, 2], 10) == hit  # the cached blocks are still there, idle
