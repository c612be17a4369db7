"""The fused attention step (RoPE, K/V writes and paged attention as one CPU op) and the
decoder-layer op (a llama layer's whole step of a few rows) compute what the separate ops
compute, bit for bit: logits and the KV they write, decode and verify steps, float32 and
float16 pools, and an engine's greedy tokens."""

from __future__ import annotations

import asyncio

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from attention_step_helpers import fused_then_apart, prefilled
from conftest import TINY_CONFIG, write_tiny_model
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch
from mlx_parallm_provider.models import attention, backend, backends, fused_ops, registry
from mlx_parallm_provider.models.backends import layer_step

WIDE_CONFIG = {**TINY_CONFIG, "head_dim": 32}
"""head_dim 32: quantized KV blocks group 32 values (mx.quantize takes no smaller group)."""
QUANTIZED = [8, 4]


def _rope_model(folder):
    loaded = registry._load_uncached(str(folder), None)
    backend = backends.of(loaded.model)
    if not backend.kernels or not attention.has_attention_step():
        pytest.skip("no CPU kernels extension (no compiler): the fused step does not exist")
    assert fused_ops.install(loaded.model, backend) > 0
    return loaded


@pytest.fixture(scope="module")
def rope_model(tiny_model_dir):
    """A fresh tiny llama with the fused RMSNorm / RoPE modules a quantized checkpoint gets at
    load on the CPU (the fused step needs the RoPE's inverse frequencies)."""
    return _rope_model(tiny_model_dir)


@pytest.fixture(scope="module")
def wide_rope_model(smollm_tokenizer_dir, tmp_path_factory):
    """:func:`rope_model` with heads of 32 (quantized KV blocks take them)."""
    return _rope_model(write_tiny_model(tmp_path_factory.mktemp("tiny-d32-rope"), smollm_tokenizer_dir, config=WIDE_CONFIG))


def _quantized_steps() -> bool:
    return bool(getattr(attention._extension(), "step_quantized_pools", False))


def _counted(monkeypatch, name: str) -> list[int]:
    """A list that grows by one at each call of ``attention.<name>``."""
    calls: list[int] = []
    fused = getattr(attention, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(attention, name, counted)
    return calls


@pytest.fixture
def steps(monkeypatch):
    """Counts the fused attention step's calls."""
    return _counted(monkeypatch, "paged_attention_step")


def _fused_off(monkeypatch) -> None:
    monkeypatch.setattr(attention, "has_attention_step", lambda: False)


@pytest.mark.parametrize("dtype", [None, mx.float16], ids=["float32-pools", "float16-pools"])
@pytest.mark.parametrize("width", [1, 3, 24], ids=["decode", "verify", "prefill"])
def test_a_fused_step_gives_the_logits_and_kv_of_the_separate_ops(rope_model, steps, monkeypatch, dtype, width):
    layers = len(rope_model.model.layers)

    def turn_off() -> None:
        assert len(steps) == layers
        _fused_off(monkeypatch)

    fused_then_apart(rope_model.model, dtype, width, turn_off)
    assert len(steps) == layers  # (the separate ops ran)


@pytest.mark.parametrize("bits", QUANTIZED, ids=["int8-pools", "int4-pools"])
@pytest.mark.parametrize("width", [1, 3, 24], ids=["decode", "verify", "prefill"])
def test_a_fused_step_over_quantized_pools_gives_the_logits_and_kv_of_the_separate_ops(wide_rope_model, steps, monkeypatch, bits,
                                                                                      width):
    if not _quantized_steps():
        pytest.skip("the extension's steps do not take quantized pools")
    layers = len(wide_rope_model.model.layers)

    def turn_off() -> None:
        assert len(steps) == layers
        _fused_off(monkeypatch)

    fused_then_apart(wide_rope_model.model, None, width, turn_off, bits)
    assert len(steps) == layers


def test_the_step_quantizes_as_mx_quantize_does_bit_for_bit() -> None:
    """The fused step's own quantization of the K/V it writes against ``mx.quantize`` (of
    the values as float16), over values that reach its edge cases: constant groups, zeros,
    one sign only, tiny and huge ranges, values on rounding ties."""
    ext = attention._extension()
    if ext is None or not _quantized_steps():
        pytest.skip("the extension's steps do not take quantized pools")
    rng = np.random.default_rng(7)
    D, KVH = 64, 2
    groups = [rng.standard_normal(D) * s for s in (1e-6, 1e-3, 0.1, 1, 30, 1e3, 3e4)]
    groups += [np.zeros(D), np.full(D, 3.0), np.full(D, -2.5), -np.abs(rng.standard_normal(D)), np.abs(rng.standard_normal(D)),
               rng.integers(-8, 8, D).astype(float), rng.integers(0, 256, D) / 16.0, rng.integers(0, 16, D) * 0.5 - 3.75,
               np.concatenate([np.full(32, 1e-8), rng.standard_normal(32)]), np.linspace(-1, 1, D), np.full(D, 7e4)]
    rows = np.clip(np.stack(groups + [rng.standard_normal(D) * 10 for _ in range(64)]), -6e4, 6e4).astype(np.float32)
    n = rows.shape[0] // KVH * KVH
    k = rows[:n].reshape(n // KVH, 1, KVH * D)
    v = k[::-1].copy()
    B = k.shape[0]
    inv_freq = mx.zeros((D // 2,), mx.float32)  # (position 0, no rotation: the values are written as given)
    for bits in QUANTIZED:
        slots = B + 1
        pools = [mx.zeros((slots, KVH, D * bits // 32), mx.uint32) for _ in range(2)]
        scales = [mx.zeros((slots, KVH, D // 32), mx.float16) for _ in range(4)]
        out = ext.paged_attention_step(mx.zeros((B, 1, KVH * D)), mx.array(k), mx.array(v), pools[0], pools[1],
                                       mx.arange(1, B + 1, dtype=mx.int32), mx.arange(1, B + 1, dtype=mx.int32).reshape(B, 1),
                                       mx.ones((B,), mx.int32), mx.zeros((B,), mx.int32), inv_freq, KVH, D, False, 1.0, 1, 1.0,
                                       1, scales)
        mx.eval(out)
        for x, codes, (s, b) in ((k, pools[0], scales[:2]), (v, pools[1], scales[2:])):
            want = mx.quantize(mx.array(x.reshape(B, KVH, D)).astype(mx.float16), group_size=32, bits=bits)
            for mine, theirs in zip((codes[1:], s[1:], b[1:]), want):
                assert mx.array_equal(mine, theirs).item(), bits


def test_prefill_pieces_of_any_width_fuse(rope_model, steps):
    model = rope_model.model
    kv, storage = prefilled(model, [[1, 2, 3, 4, 5], [6, 7]], 4, None)
    assert steps == []  # (the pools did not exist before this first pass)

    def piece(width: int) -> None:
        starts = list(done)
        for b in range(2):
            kv.grow(b, done[b] + width)
        storage.reserve(kv.pool.high_water())
        batch = PagedBatch(storage, [kv.table(b) for b in range(2)], starts, [width, width], width)
        mx.eval(model(mx.array([[9] * width] * 2), cache=batch.layers()))
        for b in range(2):
            done[b] += width

    done = [5, 2]
    piece(40)
    assert len(steps) == len(model.layers)  # a wide piece after held tokens: the fused step
    piece(5)
    assert len(steps) == 2 * len(model.layers)


def test_an_engine_decodes_the_same_tokens_with_the_fused_step_and_without(rope_model, make_engine, steps, monkeypatch):
    prompts = [[1, 5, 9, 14, 2, 5, 9, 14, 2, 5][: 4 + i] for i in range(5)]  # repeats: n-gram drafts get verified

    def tokens(**config) -> list[list[int]]:
        engine = make_engine(rope_model.model, **config)
        return [c.token_ids for c in asyncio.run(engine.generate_many(prompts, SamplingParams(max_tokens=12, ignore_eos=True)))]

    fused = tokens(speculative="ngram")
    assert steps  # decode and verify steps ran fused
    ran = len(steps)
    _fused_off(monkeypatch)
    assert tokens(speculative="ngram") == fused
    assert len(steps) == ran


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def packed_model(request, tiny_model_dir, smollm_tokenizer_dir, tmp_path_factory):
    """A tiny llama, or qwen2 (q/k/v with biases), quantized to 4 bits and prepared as a
    served checkpoint is (packed weights, fused norms and RoPE): every layer one the one-op
    step takes."""
    folder = tiny_model_dir
    if request.param == "qwen2":
        folder = write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), smollm_tokenizer_dir,
                                  config={**TINY_CONFIG, "model_type": "qwen2", "tie_word_embeddings": True})
    return _packed_model(folder, request.param == "qwen2")


@pytest.fixture(scope="module")
def wide_packed_model(smollm_tokenizer_dir, tmp_path_factory):
    """:func:`packed_model`'s llama with heads of 32 (quantized KV blocks take them)."""
    return _packed_model(write_tiny_model(tmp_path_factory.mktemp("tiny-d32-packed"), smollm_tokenizer_dir, config=WIDE_CONFIG), False)


def _packed_model(folder, qwen2: bool):
    import mlx_lm

    model, _ = mlx_lm.load(str(folder))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    backend.prepare_model(model, dequantize=True)
    if not backends.of(model).kernels or not attention.has_attention_step():
        pytest.skip("no CPU kernels extension (no compiler): the fused ops do not exist")
    plans = [layer_step.plan_of(layer) for layer in model.layers]
    assert all(plan is not None and (plan.qkv_bias is not None) == qwen2 for plan in plans)
    return model


@pytest.fixture
def layers(monkeypatch):
    """Counts the decoder-layer op's calls."""
    return _counted(monkeypatch, "decoder_layer")


def _layers_off(model, monkeypatch) -> None:
    monkeypatch.setattr(layer_step, "plan_of", lambda block: None)
    monkeypatch.setattr(backends.of(model), "_plans", {})  # (the plans made so far come back after the test)


# (the matmul each row count takes; at 4 a verify step's 4 real rows and its padded 6 fall on
# either side: the layer op takes the padded pass's kernel, as the separate ops do)
@pytest.mark.parametrize("packed_rows", [8, 4, 1], ids=["packed-kernel", "real-rows-packed", "panels"])
@pytest.mark.parametrize("dtype", [None, mx.float16], ids=["float32-pools", "float16-pools"])
@pytest.mark.parametrize("width", [1, 2], ids=["decode", "verify"])
def test_a_layer_as_one_op_gives_the_logits_and_kv_of_its_ops(packed_model, layers, steps, monkeypatch, dtype, width, packed_rows):
    monkeypatch.setattr(backends.of(packed_model), "packed_rows", packed_rows)
    count = len(packed_model.layers)

    def turn_off() -> None:
        assert len(layers) == count and steps == []  # whole layers, no separate attention step
        _layers_off(packed_model, monkeypatch)

    fused_then_apart(packed_model, dtype, width, turn_off)
    assert len(layers) == count and len(steps) == count  # (each layer's own ops ran)


@pytest.mark.parametrize("bits", QUANTIZED, ids=["int8-pools", "int4-pools"])
@pytest.mark.parametrize("width", [1, 2], ids=["decode", "verify"])
def test_a_layer_as_one_op_over_quantized_pools_gives_the_logits_and_kv_of_its_ops(wide_packed_model, layers, steps, monkeypatch,
                                                                                  bits, width):
    if not _quantized_steps():
        pytest.skip("the extension's steps do not take quantized pools")
    count = len(wide_packed_model.layers)

    def turn_off() -> None:
        assert len(layers) == count and steps == []
        _layers_off(wide_packed_model, monkeypatch)

    fused_then_apart(wide_packed_model, None, width, turn_off, bits)
    assert len(layers) == count and len(steps) == count


def test_steps_of_more_rows_than_the_panels_take_keep_the_layers_ops(packed_model, layers, steps):
    model = packed_model
    prompts = [[1 + b, 2, 3] for b in range(9)]
    kv, storage = prefilled(model, prompts, 4, None)
    for b in range(9):
        kv.grow(b, 3 + 15)
    storage.reserve(kv.pool.high_water())
    batch = PagedBatch(storage, [kv.table(b) for b in range(9)], [3] * 9, [15] * 9, 15)  # 135 rows
    mx.eval(model(mx.array([[4] * 15] * 9), cache=batch.layers()))
    assert layers == [] and len(steps) == len(model.layers)  # (the attention step still fused)


def test_an_engine_decodes_the_same_tokens_with_layers_as_one_op_and_without(packed_model, make_engine, layers, monkeypatch):
    prompts = [[1, 5, 9, 14, 2, 5, 9, 14, 2, 5][: 4 + i] for i in range(5)]

    def tokens(**config) -> list[list[int]]:
        engine = make_engine(packed_model, **config)
        return [c.token_ids for c in asyncio.run(engine.generate_many(prompts, SamplingParams(max_tokens=12, ignore_eos=True)))]

    fused = tokens(speculative="ngram")
    assert layers
    ran = len(layers)
    _layers_off(packed_model, monkeypatch)
    assert tokens(speculative="ngram") == fused
    assert len(layers) == ran


def test_ragged_verify_steps_give_the_tokens_of_padded_ones(packed_model, make_engine, layers, monkeypatch):
    """Constrained rows beside plain ones: each verify step's rows hold drafts of different
    lengths (forced tokens) or none. With every layer one op, the step computes the real
    positions only, and its rows decode the same tokens as with each layer's own ops (which
    compute the padding too)."""
    from mlx_parallm_provider.engine import Constraint

    schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "city": {"type": "string", "maxLength": 6}},
              "required": ["name", "city"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=24, ignore_eos=True, constraint=Constraint.json_schema(schema) if i % 2 else None)
              for i in range(5)]
    prompts = [[1, 5, 9, 14, 2, 5, 9][: 3 + i] for i in range(5)]

    def run() -> tuple[list[list[int]], dict, bool]:
        engine = make_engine(packed_model, speculative_max_batch=8)

        async def together():
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

        done = asyncio.run(together())
        return [c.token_ids for c in done], engine.stats()["fast_forward"], engine._core.drafting.times.ragged

    tokens, stats, ragged = run()
    assert layers and ragged and stats["fast_forward_steps"] > 0 and stats["accepted_tokens"] > 10, stats
    _layers_off(packed_model, monkeypatch)
    again, stats_apart, ragged_apart = run()
    assert again == tokens and not ragged_apart and stats_apart["fast_forward_steps"] > 0
