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


def test_gemma2s_routed_attention_computes_what_mlx_lms_own_does_with_every_cache():
    """gemma2 computes its softcapped scores itself; routed, its attention goes through the
    backend (the paged KV's attend() in the engine) and gives mlx-lm's own numbers: no cache,
    mlx-lm's KVCache (a prefill then decode steps), its quantized cache, GQA, a hard cap."""
    import copy

    from mlx_lm.models import gemma2
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_parallm_provider.models.backends import MLXOps

    args = gemma2.ModelArgs.from_dict({
        "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 300, "rope_theta": 10000.0,
        "query_pre_attn_scalar": 1, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 30.0})
    mx.random.seed(3)
    own = gemma2.Model(args)
    mx.eval(own.parameters())
    routed = copy.deepcopy(own)
    assert backends.install(routed, MLXOps()) and type(routed.layers[0].self_attn) is not gemma2.Attention
    assert type(own.layers[0].self_attn) is gemma2.Attention  # another model of the module keeps mlx-lm's class
    prompt, steps = mx.array([[5, 9, 31, 7, 2, 250, 11]]), [[17], [4], [99]]

    def run(model, make_cache) -> list[mx.array]:
        cache = [make_cache() for _ in model.layers] if make_cache else None
        outs = [model(prompt, cache=cache)]
        for token in steps if cache else []:
            outs.append(model(mx.array([token]), cache=cache))
        return outs

    for make_cache in (None, KVCache):
        want, got = run(own, make_cache), run(routed, make_cache)
        for w, g in zip(want, got):
            assert mx.abs(w - g).max().item() <= 1e-5 * mx.abs(w).max().item()
    # mlx-lm's gemma2 takes no quantized cache; routed, its K/V are dequantized for the attention
    for w, g in zip(run(own, KVCache), run(routed, lambda: QuantizedKVCache(group_size=32, bits=8))):
        assert mx.abs(w - g).max().item() <= 2e-2 * mx.abs(w).max().item()
    # the cap is applied: without it the numbers differ
    uncapped = copy.deepcopy(own)
    for layer in uncapped.layers:
        layer.self_attn.attn_logit_softcapping = 1e6
    assert mx.abs(run(uncapped, None)[0] - run(own, None)[0]).max().item() > 1e-3


def test_softcapped_attention_takes_mlx_lms_mask_forms():
    """A causal mask given as mlx-lm's ``"causal"``, as booleans, or as additive -inf: the same
    numbers (a piece of 3 queries after 4 earlier keys)."""
    from mlx_parallm_provider.models.softcap import softcapped_attention

    q = mx.random.normal((2, 4, 3, 16), key=mx.random.key(1))
    k, v = (mx.random.normal((2, 2, 7, 16), key=mx.random.key(i)) for i in (2, 3))
    seen = mx.arange(7)[None, :] <= (4 + mx.arange(3))[:, None]
    causal = softcapped_attention(q, k, v, 0.25, "causal", 0.5)
    assert mx.allclose(causal, softcapped_attention(q, k, v, 0.25, seen, 0.5), atol=1e-6).item()
    additive = mx.where(seen, 0.0, -mx.inf)[None, None]  # (1, 1, L, S)
    assert mx.allclose(causal, softcapped_attention(q, k, v, 0.25, additive, 0.5), atol=1e-6).item()
    assert not mx.allclose(causal, softcapped_attention(q, k, v, 0.25, None, 0.5), atol=1e-3).item()
