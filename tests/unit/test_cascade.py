"""cascade_attention on its own (engine/kv/cascade.py): shared prefixes + each row's own KV,
merged by log-sum-exp, equal plain attention over the concatenation; the backend's ``exp``
computes the softmax parts."""

from __future__ import annotations

import mlx.core as mx

from mlx_parallm_provider.engine.kv.cascade import SharedPrefix, cascade_attention

H, KV, D = 4, 2, 16


def test_cascade_attention_equals_plain_attention_over_prefix_and_own_tokens() -> None:
    mx.random.seed(0)
    B, L, S, P = 3, 2, 5, 7
    prefix = SharedPrefix(mx.random.normal((1, KV, P, D)), mx.random.normal((1, KV, P, D)), (1, 2, 3))
    assert prefix.length == P
    q, k, v = mx.random.normal((B, H, L, D)), mx.random.normal((B, KV, S, D)), mx.random.normal((B, KV, S, D))
    mask = mx.tril(mx.ones((L, S), dtype=mx.bool_), k=S - L)[None, None]  # causal over the own tokens
    exps: list[int] = []
    got = cascade_attention(q, k, v, 0.25, mask, [(prefix, mx.array([0, 2]))], exp=lambda x: exps.append(1) or mx.exp(x))
    assert len(exps) == 2  # the own part's softmax and the group's
    for row in range(B):
        shared = row in (0, 2)  # row 1 has no prefix
        keys = mx.concatenate([prefix.keys, k[row : row + 1]], axis=2) if shared else k[row : row + 1]
        values = mx.concatenate([prefix.values, v[row : row + 1]], axis=2) if shared else v[row : row + 1]
        m = mx.concatenate([mx.ones((1, 1, L, P), dtype=mx.bool_), mask], axis=3) if shared else mask
        want = mx.fast.scaled_dot_product_attention(q[row : row + 1], keys, values, scale=0.25, mask=m)
        assert mx.abs(got[row : row + 1] - want).max().item() < 1e-5, row
