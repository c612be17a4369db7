"""SharedPrefixBatchCache: cascade attention equals plain attention over per-row copies,
through the batch operations the worker uses (filter, extend, right-padded prefill)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from mlx_parallm_provider.engine.cascade import SharedPrefix
from mlx_parallm_provider.engine.shared_kv import SharedPrefixBatchCache

H, KV, D = 4, 2, 16


def _prefix(n: int, seed: int, key: bytes) -> SharedPrefix:
    mx.random.seed(seed)
    return SharedPrefix(mx.random.normal((1, KV, n, D)), mx.random.normal((1, KV, n, D)), key)


def _reference(cache: SharedPrefixBatchCache, q: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
    """Plain attention with each row's prefix copied in front of its own (left-padded) KV."""
    L = q.shape[2]
    longest = max([0] + [p.length for p in cache.prefixes if p is not None])
    ks, vs, ms = [], [], []
    for i, p in enumerate(cache.prefixes):
        n = 0 if p is None else p.length
        pad = longest - n
        zeros = mx.zeros((1, KV, pad, D))
        pk = zeros if p is None else mx.concatenate([zeros, p.keys], axis=2)
        pv = zeros if p is None else mx.concatenate([zeros, p.values], axis=2)
        ks.append(mx.concatenate([pk, keys[i : i + 1]], axis=2))
        vs.append(mx.concatenate([pv, values[i : i + 1]], axis=2))
        head = mx.array([False] * pad + [True] * n).reshape(1, 1, 1, -1)
        ms.append(mx.concatenate([mx.broadcast_to(head, (1, 1, L, longest)), mx.broadcast_to(mask[i : i + 1], (1, 1, L, keys.shape[2]))], axis=3))
    return mx.fast.scaled_dot_product_attention(q, mx.concatenate(ks), mx.concatenate(vs), scale=0.25, mask=mx.concatenate(ms))


def _step(cache: SharedPrefixBatchCache, L: int, seed: int, valid: list[int]) -> float:
    """Run ``L`` new tokens per row through ``cache``; max error against the reference over
    the query positions that are real tokens (the last ``valid[i]`` of row i)."""
    B = len(cache.prefixes)
    mx.random.seed(seed)
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(mx.random.normal((B, KV, L, D)), mx.random.normal((B, KV, L, D)))
    q = mx.random.normal((B, H, L, D))
    got = cache.attend(q, keys, values, scale=0.25, mask=mask)
    want = _reference(cache, q, keys, values, mx.broadcast_to(mask, (B, 1, L, keys.shape[2])))
    assert mx.isfinite(got).all().item()
    real = mx.array([[0] * (L - v) + [1] * v for v in valid]).reshape(B, 1, L, 1)
    return (mx.abs(got - want) * real).max().item()


def test_cascade_matches_plain_attention_for_mixed_groups_and_unshared_rows() -> None:
    a, b = _prefix(40, 1, b"a"), _prefix(25, 2, b"b")
    cache = SharedPrefixBatchCache(BatchKVCache([0, 2, 0, 3, 1]), [a, a, b, None, b])
    assert [len(rows.tolist()) for _, rows in cache.groups()] == [2, 2]
    assert _step(cache, 4, 3, [4, 2, 4, 1, 3]) < 1e-5  # prefill of the rows' own tokens
    for step in range(3):
        assert _step(cache, 1, 10 + step, [1] * 5) < 1e-5  # decode
    assert cache.offset.tolist() == [40 + 7, 40 + 5, 25 + 7, 4, 25 + 6]


def test_rows_leave_and_join_mid_decode() -> None:
    a = _prefix(30, 4, b"a")
    cache = SharedPrefixBatchCache(BatchKVCache([0, 1, 0]), [a, a, None])
    _step(cache, 3, 5, [3, 2, 3])
    cache.filter([1, 2])  # the first row finished
    assert _step(cache, 1, 6, [1, 1]) < 1e-5
    # Rows joining: one shares the same prefix tokens (a separate copy that is dropped for
    # the one already here), one has a prefix of its own.
    again, other = _prefix(30, 4, b"a"), _prefix(12, 7, b"c")
    joining = SharedPrefixBatchCache(BatchKVCache([0, 0]), [again, other])
    _step(joining, 2, 8, [2, 2])
    cache.extend(joining)
    assert cache.prefixes[2] is cache.prefixes[0] is a and cache.prefixes[3] is other
    assert cache.nbytes == cache.suffix.nbytes + a.keys.nbytes * 2 + other.keys.nbytes * 2
    for step in range(2):
        assert _step(cache, 1, 20 + step, [1] * 4) < 1e-5
    cache.filter([1, 3])
    assert _step(cache, 1, 30, [1, 1]) < 1e-5
    cache.filter([0])  # no shared prefix left: plain attention
    assert cache.groups() == [] and _step(cache, 1, 31, [1]) < 1e-5


def test_right_padded_prefill_and_row_kv() -> None:
    a = _prefix(20, 9, b"a")
    cache = SharedPrefixBatchCache(BatchKVCache([0, 0, 0]), [a, None, a])
    mx.random.seed(11)
    keys = mx.random.normal((3, KV, 5, D))
    cache.update_and_fetch(keys, keys + 1)
    cache.prepare(right_padding=[0, 2, 3])
    cache.finalize()
    assert cache.left_padding.tolist() == [0, 2, 3]
    assert [cache.row_length(i) for i in range(3)] == [25, 3, 22]
    k, v = cache.row_kv(2, 18, 22)  # two prefix tokens, then the row's own two
    assert mx.array_equal(k[:, :, :2], a.keys[:, :, 18:20]).item()
    assert mx.array_equal(k[:, :, 2:], keys[2:3, :, :2]).item() and mx.array_equal(v[:, :, 2:], keys[2:3, :, :2] + 1).item()
    assert _step(cache, 1, 12, [1, 1, 1]) < 1e-5


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_is_computed_in_float32(dtype) -> None:
    a = _prefix(64, 13, b"a")
    a.keys, a.values = a.keys.astype(dtype), a.values.astype(dtype)
    cache = SharedPrefixBatchCache(BatchKVCache([0, 0]), [a, a])
    mask = cache.make_mask(1)
    mx.random.seed(14)
    keys, values = cache.update_and_fetch(mx.random.normal((2, KV, 1, D)).astype(dtype), mx.random.normal((2, KV, 1, D)).astype(dtype))
    q = mx.random.normal((2, H, 1, D)).astype(dtype)
    got = cache.attend(q, keys, values, scale=0.25, mask=mask)
    want = _reference(cache, q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), mx.broadcast_to(mask, (2, 1, 1, 1)))
    assert got.dtype == dtype and mx.abs(got.astype(mx.float32) - want).max().item() < 2e-2


def test_a_row_holding_its_own_copy_adopts_the_shared_one() -> None:
    a = _prefix(24, 15, b"a")
    mx.random.seed(16)
    own = mx.random.normal((1, KV, 3, D))
    # Row 0 computed the prefix itself: its own KV is the prefix's 24 tokens + 3 more.
    plain = SharedPrefixBatchCache(BatchKVCache([0]), [None])
    plain.update_and_fetch(mx.concatenate([a.keys, own], axis=2), mx.concatenate([a.values, own], axis=2))
    joining = SharedPrefixBatchCache(BatchKVCache([0, 1]), [a, a])
    _step(joining, 2, 17, [2, 1])
    before = plain.offset.tolist()
    plain.adopt({0: a})
    assert plain.prefixes[0] is a and plain.offset.tolist() == before == [27]
    assert plain.suffix.size() == 3 and plain.row_length(0) == 27  # the copy is gone
    plain.extend(joining)
    assert plain.suffix.size() == 3 and plain.offset.tolist() == [27, 26, 25]
    k, _ = plain.row_kv(0, 22, 27)
    assert mx.array_equal(k, mx.concatenate([a.keys[:, :, 22:], own], axis=2)).item()
    for step in range(2):
        assert _step(plain, 1, 18 + step, [1, 1, 1]) < 1e-5


def test_decode_rows_adopt_a_joining_prefix_with_their_tokens_only() -> None:
    from array import array

    from mlx_parallm_provider.engine.prefix_kv import adopt_shared_prefixes

    tokens = list(range(100, 124))
    a = _prefix(24, 19, array("q", tokens).tobytes())
    mx.random.seed(20)
    layers = []
    for _ in range(2):
        own = mx.random.normal((3, KV, 26, D))
        layer = SharedPrefixBatchCache(BatchKVCache([0, 0, 0]), [None, None, None])
        layer.update_and_fetch(own, own)
        layers.append(layer)
    joining = [SharedPrefixBatchCache(BatchKVCache([0]), [a]) for _ in range(2)]
    # Row 0 starts with the prefix's tokens, row 1 does not, row 2 is shorter than it.
    sequences = [tokens + [1, 2], [7] + tokens[1:] + [1, 2], tokens[:20]]
    adopt_shared_prefixes(layers, sequences, joining)
    assert [p is a for p in layers[1].prefixes] == [True, False, False]
    assert layers[0].offset.tolist() == [26, 26, 26] and layers[0].left_padding.tolist() == [24, 0, 0]
