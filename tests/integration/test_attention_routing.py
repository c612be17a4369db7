"""Attention is routed by cache type: caches with an ``attend`` method compute it, others
get mlx-lm's function, and a loaded model's output does not change with the hook in place."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_parallm_provider.models import attention


class CountingCache(KVCache):
    """A KVCache that computes attention itself (with mlx-lm's function) and counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def attend(self, queries, keys, values, scale, mask):
        self.calls += 1
        return attention.mlx_lm_attention(queries, keys, values, cache=None, scale=scale, mask=mask)


def test_loaded_model_routes_attention_through_the_hook(tiny_model):
    module = __import__(type(tiny_model.model).__module__, fromlist=["x"])
    assert module.scaled_dot_product_attention is attention.attend
    assert attention.install(tiny_model.model) is True  # idempotent


def test_cache_with_attend_computes_attention_and_output_is_unchanged(tiny_model):
    model = tiny_model.model
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    plain = [KVCache() for _ in model.layers]
    own = [CountingCache() for _ in model.layers]
    expected = model(tokens, cache=plain)
    got = model(tokens, cache=own)
    assert [c.calls for c in own] == [1] * len(model.layers)
    assert mx.allclose(expected, got).item()
    step_expected = model(mx.array([[7]]), cache=plain)
    step_got = model(mx.array([[7]]), cache=own)
    assert [c.calls for c in own] == [2] * len(model.layers)
    # the plain cache's one-token step runs the CPU decode kernel, which sums in another order
    assert mx.allclose(step_expected, step_got, rtol=1e-5, atol=1e-4).item()


def test_model_from_another_module_is_left_alone():
    class Stranger:
        pass

    assert attention.install(Stranger()) is False
