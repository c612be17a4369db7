"""The prefix store (radix tree of token ids -> KV) and the scheduler's use of it."""

from __future__ import annotations

import mlx_parallm_provider  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import pytest

from mlx_parallm_provider.engine.prefix_cache import PrefixCache
from mlx_parallm_provider.engine.prefix_match import common_prefix_len
from mlx_parallm_provider.engine.request import Request, ResultSink, SamplingParams
from mlx_parallm_provider.engine.scheduler import Scheduler

LAYERS, HEADS, DIM = 2, 1, 2
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4


def kv_of(tokens: list[int]):
    """Fake KV whose every entry encodes its token id (and layer), so slices are checkable."""
    t = mx.array(tokens, dtype=mx.float32)[None, None, :, None]
    full = [(mx.broadcast_to(t + layer, (1, HEADS, len(tokens), DIM)), mx.broadcast_to(-t - layer, (1, HEADS, len(tokens), DIM))) for layer in range(LAYERS)]
    return lambda a, b: [(k[:, :, a:b], v[:, :, a:b]) for k, v in full]


def keys_tokens(kv, layer: int = 0) -> list[int]:
    return [int(x) - layer for x in kv[layer][0][0, 0, :, 0].tolist()]


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3, 4], [1, 2, 9, 4], 2), (list(range(100)), list(range(57)) + [0], 57)])
def test_common_prefix_len(a, b, n) -> None:
    assert common_prefix_len(a, b) == n == common_prefix_len(b, a)


def test_match_fetch_and_split() -> None:
    store = PrefixCache(max_bytes=10**6)
    a = [1, 2, 3, 4, 5, 6]
    assert store.insert(a, kv_of(a), BYTES_PER_TOKEN) == 6
    assert store.match([1, 2, 3, 9]) == 3 and store.match([7]) == 0 and store.match(a + [7]) == 6
    assert keys_tokens(store.fetch([1, 2, 3, 9], 3)) == [1, 2, 3]
    b = [1, 2, 3, 7, 8]
    assert store.insert(b, kv_of(b), BYTES_PER_TOKEN) == 2  # only the new tail is stored
    assert store.num_tokens == 8 and store.nbytes == 8 * BYTES_PER_TOKEN
    assert keys_tokens(store.fetch(b, 5), layer=1) == b
    assert keys_tokens(store.fetch(a, 6)) == a
    assert store.insert(a[:4], kv_of(a[:4]), BYTES_PER_TOKEN) == 0


def test_lru_eviction_keeps_the_bound_and_recent_paths() -> None:
    store = PrefixCache(max_bytes=10 * BYTES_PER_TOKEN)
    old, recent, new = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    store.insert(old, kv_of(old), BYTES_PER_TOKEN)
    store.insert(recent, kv_of(recent), BYTES_PER_TOKEN)
    store.fetch(old, 2)  # old is now more recently used than recent
    store.insert(new, kv_of(new), BYTES_PER_TOKEN)
    assert store.nbytes <= store.max_bytes
    assert store.match(recent) == 0 and store.match(old) == 4 and store.match(new) == 4
    assert store.stats()["evictions"] == 1
    assert store.insert(list(range(100, 120)), kv_of(list(range(100, 120))), BYTES_PER_TOKEN) == 0  # larger than the store


def test_eviction_takes_leaves_before_their_parents() -> None:
    store = PrefixCache(max_bytes=9 * BYTES_PER_TOKEN)
    base = [1, 2, 3, 4]
    store.insert(base + [5, 6], kv_of(base + [5, 6]), BYTES_PER_TOKEN)
    store.insert(base + [7, 8], kv_of(base + [7, 8]), BYTES_PER_TOKEN)  # splits: [1..4] -> [5,6], [7,8]
    store.insert([20, 21], kv_of([20, 21]), BYTES_PER_TOKEN)  # 10 tokens > 9: evict the LRU leaf
    assert store.nbytes <= store.max_bytes
    assert store.match(base + [5, 6]) == 4 and store.match(base + [7, 8]) == 6 and store.match([20, 21]) == 2


class _ScanningStore(PrefixCache):
    """The eviction rule as first written (a walk of the whole tree per evicted leaf): the
    reference the heap must agree with."""

    def _evict(self, protect) -> None:
        keep, node = set(), protect
        while node is not None:
            keep.add(id(node))
            node = node.parent
        while self.nbytes > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children]
            leaves = [n for n in leaves if id(n) not in keep] or leaves
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.tokens[0]]
            self.nbytes -= victim.nbytes
            self.num_tokens -= len(victim.tokens)
            self.evictions += 1


def _stored(store: PrefixCache) -> set[tuple[int, ...]]:
    """Every root-to-leaf token path the store holds."""
    out, stack = set(), [((), n) for n in store._root.children.values()]  # noqa: SLF001
    while stack:
        path, node = stack.pop()
        path += node.tokens
        if node.children:
            stack.extend((path, c) for c in node.children.values())
        else:
            out.add(path)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_heap_eviction_evicts_what_a_tree_walk_would(seed: int) -> None:
    import random

    rng = random.Random(seed)
    heap, scan = PrefixCache(40 * BYTES_PER_TOKEN), _ScanningStore(40 * BYTES_PER_TOKEN)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 5))] + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        if rng.random() < 0.6:
            assert heap.insert(seq, kv_of(seq), BYTES_PER_TOKEN) == scan.insert(seq, kv_of(seq), BYTES_PER_TOKEN)
        else:
            n = heap.match(seq)
            assert n == scan.match(seq)
            if n:
                assert keys_tokens(heap.fetch(seq, n)) == seq[:n]
                scan.fetch(seq, n)
        assert _stored(heap) == _stored(scan) and heap.nbytes == scan.nbytes <= heap.max_bytes
    assert heap.evictions == scan.evictions > 50


def test_eviction_does_not_walk_the_tree() -> None:
    """Issue 21 item 15: each evicted leaf was found by scanning every node (one 20k-token
    insert into a store of 20k entries held the worker 5.1 s)."""
    store = PrefixCache(2000 * BYTES_PER_TOKEN)
    for i in range(2000):
        store.insert([i, -1], kv_of([i, -1]), BYTES_PER_TOKEN)  # the store ends with 1,000 leaves of 2 tokens
    visited = 0
    nodes = store._nodes  # noqa: SLF001

    def counting():
        nonlocal visited
        for node in nodes():
            visited += 1
            yield node

    store._nodes = counting  # type: ignore[method-assign]  # noqa: SLF001
    big = list(range(10_000, 11_000))
    assert store.insert(big, kv_of(big), BYTES_PER_TOKEN) == 1000
    assert store.evictions >= 500 and store.nbytes <= store.max_bytes
    assert visited < 10 * 1000, f"{visited} nodes walked for {store.evictions} evictions"


def req(name: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens), ResultSink())


def test_scheduler_counts_only_uncached_tokens_against_the_budget() -> None:
    match = lambda ids: 100 if ids[:100] == list(range(100)) else 0  # noqa: E731
    s = Scheduler(8, 60, 200, prefix_match=match)
    a, b = req("a", list(range(100)) + [500, 501]), req("b", list(range(100)) + [600])
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.prefill == [a, b] and a.num_cached == b.num_cached == 100 and a.num_prefilled == 100
    # (2 rows x 2 uncached tokens fit a budget of 60 that 2 x 102 would not)


def test_scheduler_holds_sharers_back_until_the_prefix_is_stored() -> None:
    stored: set[tuple[int, ...]] = set()
    match = lambda ids: max((common_prefix_len(p, ids) for p in stored), default=0)  # noqa: E731
    s = Scheduler(8, 4096, 1000, prefix_match=match, min_shared_tokens=64)
    prefix = list(range(1, 201))
    group = [req(f"g{i}", prefix + [1000 + i]) for i in range(4)]
    other = req("other", [7] * 50)
    twins = [req("t0", [9] * 20), req("t1", [9] * 20)]  # one prompt, n=2: shared whole
    for r in [*group, other, *twins]:
        s.add(r)
    plan = s.schedule()
    assert [r.request_id for r in plan.prefill] == ["g0", "other", "t0"]
    assert [r.request_id for r in s.waiting] == ["g1", "g2", "g3", "t1"]
    s.started(plan.prefill)
    stored.update(tuple(r.prompt_ids) for r in plan.prefill)
    plan = s.schedule()
    assert [r.request_id for r in plan.prefill] == ["g1", "g2", "g3", "t1"]
    assert [r.num_cached for r in plan.prefill] == [200, 200, 200, 19]


def test_scheduler_without_prefix_match_keeps_todays_policy() -> None:
    s = Scheduler(8, 4096, 1000)
    rs = [req(f"r{i}", list(range(300)) + [i]) for i in range(3)]
    for r in rs:
        s.add(r)
    assert s.schedule().prefill == rs and all(r.num_cached == 0 for r in rs)


def test_a_prefix_larger_than_the_store_is_not_waited_for() -> None:
    s = Scheduler(8, 4096, 1000, prefix_match=lambda ids: 0, prefix_capacity_tokens=100)
    rs = [req(f"r{i}", list(range(300)) + [i]) for i in range(3)]
    for r in rs:
        s.add(r)
    assert s.schedule().prefill == rs


def test_sharers_wait_only_for_the_tokens_a_rotating_cache_may_reuse() -> None:
    # With max_kv_size=64 a row reuses at most 63 tokens: a 200-token common prefix gains
    # 63 - 0 < min_shared_tokens, so the group is prefilled at once instead of waiting...
    capped = Scheduler(8, 4096, 1000, prefix_match=lambda ids: 0, prefix_max_tokens=63, min_shared_tokens=64)
    rs = [req(f"r{i}", list(range(300)) + [i]) for i in range(3)]
    for r in rs:
        capped.add(r)
    assert capped.schedule().prefill == rs
    # ...while under a larger cap they wait for the first one's prefill, as without a cap.
    roomy = Scheduler(8, 4096, 1000, prefix_match=lambda ids: 0, prefix_max_tokens=255, min_shared_tokens=64)
    rs = [req(f"r{i}", list(range(300)) + [i]) for i in range(3)]
    for r in rs:
        roomy.add(r)
    assert roomy.schedule().prefill == rs[:1]
