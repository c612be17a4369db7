"""Quantized KV blocks (``kv_cache_dtype`` "int8" / "int4"): real bytes in the budget, and
rows batched, sharing prefixes, speculating or preempted answer as they do alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, write_tiny_model
from mlx_parallm_provider.engine import SamplingParams

# head_dim 32: quantization groups are 32 values (mx.quantize takes no smaller group).
CONFIG = {**TINY_CONFIG, "head_dim": 32}
VALUES = 2 * 2 * 2 * 32  # K and V x layers x KV heads x head_dim, a token


@pytest.fixture(scope="module")
def wide_head_model(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from mlx_parallm_provider.models import registry

    return registry.load(str(write_tiny_model(tmp_path_factory.mktemp("tiny-d32"), smollm_tokenizer_dir, config=CONFIG)))


@pytest.fixture
def engine_of(wide_head_model):
    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine

    engines = []

    def factory(**config):
        engines.append(Engine("tiny-d32", EngineConfig(**config), loaded=wide_head_model))
        return engines[-1]

    yield factory
    for engine in engines:
        engine.shutdown()


def _prompts(n: int) -> list[list[int]]:
    return [[100 + (7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(n)]


async def _together(engine, prompts, params):
    return [c.token_ids for c in await asyncio.gather(*(engine.generate(p, params) for p in prompts))]


@pytest.mark.parametrize("dtype, bits", [("int8", 8), ("int4", 4)])
def test_quantized_blocks_count_their_real_bytes(engine_of, dtype, bits) -> None:
    # A value's code, plus a float16 scale and bias for each group of 32 values.
    per_token = VALUES * bits // 8 + VALUES // 32 * 2 * 2
    engine = engine_of(kv_cache_dtype=dtype)
    assert engine._kv_bytes_per_token == per_token  # noqa: SLF001 (what the pool is sized by)
    engine.generate_sync(_prompts(1)[0], SamplingParams(max_tokens=4))
    kv = engine.stats()["kv_cache"]
    physical = kv["kv_cache_bytes"]
    assert physical > 0 and physical % per_token == 0  # codes, scales and biases, nothing else
    half = engine_of(kv_cache_dtype="float16")
    half.generate_sync(_prompts(1)[0], SamplingParams(max_tokens=4))
    assert half.stats()["kv_cache"]["kv_cache_bytes"] * per_token == physical * VALUES * 2


def test_one_budget_holds_more_than_three_times_the_blocks_at_int4(engine_of) -> None:
    blocks = {}
    for dtype in ("float16", "int8", "int4"):
        engine = engine_of(kv_cache_dtype=dtype, kv_cache_memory_gb=0.001)
        engine.generate_sync([5, 6, 7], SamplingParams(max_tokens=2))  # (the pool is built with the engine's loop)
        blocks[dtype] = engine.stats()["kv_cache"]["kv_blocks_total"]
    assert blocks["int8"] >= 1.7 * blocks["float16"]
    assert blocks["int4"] >= 3 * blocks["float16"]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_rows_batched_sharing_speculating_and_preempted_answer_as_alone(engine_of, dtype, monkeypatch) -> None:
    from mlx_parallm_provider.engine.drafting import ngram as speculation

    def draft(self, request) -> None:  # three tokens a step (mostly rejected: their KV rolled back)
        left = request.params.max_tokens - len(request.output_ids) - 1
        request.draft = [] if request.finished else list(request.prompt_ids[-3:])[: max(0, left)]

    monkeypatch.setattr(speculation.NgramProposer, "draft", draft)
    monkeypatch.setattr(speculation.NgramProposer, "plan", lambda self, rows: 3 if len(rows) <= self.max_batch and any(
        r.draft for r in rows) else 0)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prefix = [100 + j % 50 for j in range(40)]
    prompts = [prefix + [300 + i, 301 + i, 302 + i] * (1 + i % 3) for i in range(6)] + _prompts(4)
    alone = engine_of(max_num_seqs=1, kv_cache_dtype=dtype, enable_prefix_caching=False)
    expected = [alone.generate_sync(p, params).token_ids for p in prompts]
    per_token = alone._kv_bytes_per_token  # noqa: SLF001
    configs = [
        {},
        {"speculative": "ngram", "speculative_max_batch": 16},
        # 24 blocks of 8 tokens: fewer than the rows together need, so some are preempted.
        {"kv_cache_memory_gb": 24 * 8 * per_token / 1024**3, "kv_block_size": 8, "enable_prefix_caching": False},
    ]
    for config in configs:
        engine = engine_of(kv_cache_dtype=dtype, **config)
        engine.generate_sync(prefix + [7], SamplingParams(max_tokens=2))  # the prefix cached first
        assert asyncio.run(_together(engine, prompts, params)) == expected, config
        stats = engine.stats()
        if not config:
            assert stats["cached_prompt_tokens"] >= 6 * 32  # the prefix's whole blocks, from the cache
        if "speculative" in config:
            assert stats["speculation"]["draft_tokens"] > 0
        if "kv_cache_memory_gb" in config:
            assert stats["kv_cache"]["num_preemptions"] > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_storage_reads_back_each_value_within_about_a_step_of_its_group(bits) -> None:
    import mlx.core as mx

    from mlx_parallm_provider.engine.kv.storage import PagedKVStorage

    storage = PagedKVStorage(1, num_blocks=8, block_size=4, preallocate=True, bits=bits)
    keys, values = mx.random.normal((12, 2, 64)) * 3, mx.random.normal((12, 2, 64))
    slots = mx.array([4 + i for i in range(12)], dtype=mx.int32)
    storage.write(0, slots, keys, values)
    storage.copy_blocks([(1, 5)])  # copy on write keeps codes, scales and biases together
    k, v = storage.read(0, slots)
    assert k.dtype == mx.float32 and k.shape == keys.shape
    for wrote, got in ((keys, k), (values, v)):
        groups = wrote.reshape(12, 2, 2, 32)
        step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)  # one code's width in each group
        error = mx.abs(got - wrote).reshape(12, 2, 2, 32).max(-1)
        # (mx.quantize rounds its scale and bias to float16 and places zero on a code: ~1.1 steps at most)
        assert mx.all(error <= 1.25 * step).item()
        assert mx.mean(error).item() <= 0.6 * mx.mean(step).item()
    copied, _ = storage.read(0, mx.array([20, 21, 22, 23], dtype=mx.int32))
    assert mx.array_equal(copied, k[:4]).item()


def test_int8_blocks_decode_as_float16_does(engine_of) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(6)
    half = asyncio.run(_together(engine_of(kv_cache_dtype="float16"), prompts, params))
    quantized = asyncio.run(_together(engine_of(kv_cache_dtype="int8"), prompts, params))
    assert sum(a[0] == b[0] for a, b in zip(half, quantized)) >= 5, (half, quantized)


def test_head_sizes_quantization_cannot_group_are_refused(make_engine) -> None:
    from mlx_parallm_provider.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="divisible by 32"):  # the tiny model's heads: 16 values
        make_engine(kv_cache_dtype="int8")
