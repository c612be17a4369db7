"""Attention is routed by cache type: caches with an ``attend`` method compute it (given the
model's backend), others get the backend's own, and a loaded model's output does not change
with the routing in place."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_parallm_provider.models import attention, backends


class CountingCache(KVCache):
    """A KVCache that computes attention itself (with mlx-lm's function) and counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.backends: set = set()

    def attend(self, queries, keys, values, scale, mask, backend=None):
        self.calls += 1
        self.backends.add(backend)
        return attention.mlx_lm_attention(queries, keys, values, cache=None, scale=scale, mask=mask)


def test_loaded_model_routes_attention_through_its_backend(tiny_model):
    model = tiny_model.model
    module = __import__(type(model).__module__, fromlist=["x"])
    assert module.scaled_dot_product_attention is attention.mlx_lm_attention  # mlx-lm's module untouched
    assert backends.routes_attention(model) and tiny_model.backend is backends.of(model) is not None
    attn_class = type(model.layers[0].self_attn)
    assert backends.install(model, backends.of(model)) is True  # idempotent: the same classes again
    assert type(model.layers[0].self_attn) is attn_class


def test_cache_with_attend_computes_attention_and_output_is_unchanged(tiny_model):
    model = tiny_model.model
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    plain = [KVCache() for _ in model.layers]
    own = [CountingCache() for _ in model.layers]
    expected = model(tokens, cache=plain)
    got = model(tokens, cache=own)
    assert [c.calls for c in own] == [1] * len(model.layers)
    assert all(c.backends == {backends.of(model)} for c in own)
    assert mx.allclose(expected, got).item()
    step_expected = model(mx.array([[7]]), cache=plain)
    step_got = model(mx.array([[7]]), cache=own)
    assert [c.calls for c in own] == [2] * len(model.layers)
    # the plain cache's one-token step runs the CPU decode kernel, which sums in another order
    assert mx.allclose(step_expected, step_got, rtol=1e-5, atol=1e-4).item()


def test_model_from_another_module_is_left_alone():
    class Stranger:
        pass

    assert backends.install(Stranger(), backends.MLXOps()) is False
    assert not backends.routes_attention(Stranger())
