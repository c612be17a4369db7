"""Quantized KV blocks (``kv_cache_dtype`` "int8" / "int4"): real bytes in the budget, and
rows batched, sharing prefixes, speculating or preempted answer as they do alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, write_tiny_model
from engine_helpers import PagedPieces, paged_kernel_calls
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
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompts = _prompts(6)

    async def first_tokens(engine):
        return [c.logprobs[0] for c in await asyncio.gather(*(engine.generate(p, params) for p in prompts))]

    half = asyncio.run(first_tokens(engine_of(kv_cache_dtype="float16")))
    quantized = asyncio.run(first_tokens(engine_of(kv_cache_dtype="int8")))
    # The random tiny model's top two tokens lie within ~0.01 of each other after some prompts,
    # closer than int8 moves its logits (~0.2-0.6): those first tokens are a coin toss.
    clear = [i for i, t in enumerate(half) if t.top_logprobs[0][2] - t.top_logprobs[1][2] > 0.1]
    assert len(clear) >= 3 and all(half[i].token_id == quantized[i].token_id for i in clear), (half, quantized)


def test_head_sizes_quantization_cannot_group_are_refused(make_engine) -> None:
    from mlx_parallm_provider.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="divisible by 32"):  # the tiny model's heads: 16 values
        make_engine(kv_cache_dtype="int8")


def _has_quantized_kernel() -> bool:
    from mlx_parallm_provider.models import backends, qmatmul_ext

    ext = qmatmul_ext.load() if backends.wants_kernels() else None
    return ext is not None and getattr(ext, "paged_quantized_pools", False)


def _quantized_storage(bits: int, blocks: int = 40, bs: int = 8, kv_heads: int = 3, D: int = 64):
    import mlx.core as mx

    from mlx_parallm_provider.engine.kv.storage import PagedKVStorage

    storage = PagedKVStorage(1, num_blocks=blocks, block_size=bs, preallocate=True, bits=bits)
    keys = mx.random.normal((blocks * bs, kv_heads, D), key=mx.random.key(1)) * 3
    values = mx.random.normal((blocks * bs, kv_heads, D), key=mx.random.key(2))
    storage.write(0, mx.arange(blocks * bs), keys, values)
    return storage


# Rows 0 and 1 share their first four blocks (a cached prefix: the gathered path attends them
# as a cascade); row 3's first blocks are the null block (a sliding window released them).
TABLES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9], [10], [0, 0, 0, 11, 12, 13, 14]]
STARTS = [40, 50, 3, 50]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width, lengths, window", [(1, [1, 1, 1, 1], None), (4, [4, 2, 4, 3], None), (1, [1, 1, 1, 1], 20),
                                                    (4, [4, 1, 2, 4], 20)], ids=["decode", "positions", "window", "positions-window"])
def test_kernel_reads_quantized_pools_as_the_gathered_path_does(bits, width, lengths, window, monkeypatch) -> None:
    import mlx.core as mx

    from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch
    from mlx_parallm_provider.models.backends import CPUKernels, MLXOps

    if not _has_quantized_kernel():
        pytest.skip("no paged CPU kernel for quantized pools here")
    storage = _quantized_storage(bits)
    ran = paged_kernel_calls(monkeypatch)
    q = mx.random.normal((4, 9, width, 64), key=mx.random.key(3))
    batch = PagedBatch(storage, TABLES, STARTS, lengths, width, windows=[window])
    kernel = batch.layers()[0].attend(q, q, q, 0.125, None, backend=CPUKernels(attention_threads=2))
    assert len(ran) == 1 and ran[0] is not None  # the kernel read the codes
    gathered = PagedBatch(storage, TABLES, STARTS, lengths, width, windows=[window]).layers()[0].attend(q, q, q, 0.125, None,
                                                                                                      backend=MLXOps())
    for b, n in enumerate(lengths):  # (padding positions are the gathered path's own choice)
        assert mx.allclose(kernel[b, :, :n], gathered[b, :, :n], atol=2e-5).item(), b


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_threads_and_float32_pools_of_the_dequantized_values_agree(bits) -> None:
    import mlx.core as mx

    from mlx_parallm_provider.models import attention

    if not _has_quantized_kernel():
        pytest.skip("no paged CPU kernel for quantized pools here")
    storage = _quantized_storage(bits, D=128, kv_heads=1)
    table = mx.array([t + [0] * (7 - len(t)) for t in TABLES], dtype=mx.int32)
    lengths = mx.array([s + 1 for s in STARTS], dtype=mx.int32)
    q = mx.random.normal((4, 16, 1, 128), key=mx.random.key(4))
    args = (storage.keys[0], storage.values[0], table, lengths, 8, 0.1)
    one = attention.paged_decode_attention(q, *args, threads=1, scales=storage.scales[0], bits=bits)
    two = attention.paged_decode_attention(q, *args, threads=2, scales=storage.scales[0], bits=bits)
    assert mx.array_equal(one, two).item()
    k, v = storage.read(0, mx.arange(40 * 8))
    wide = attention.paged_decode_attention(q, k, v, table, lengths, 8, 0.1, threads=1)
    assert mx.allclose(one, wide, atol=2e-6).item()
    # Pools the kernel does not read are left to the gathered path.
    assert attention.paged_decode_attention(q, *args, scales=storage.scales[0], bits=12 - bits) is None  # (the other width)
    assert attention.paged_decode_attention(q, *args, scales=storage.scales[0][:3], bits=bits) is None


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_prefill_and_decode_through_the_kernel_match_the_gathered_path(wide_head_model, dtype, monkeypatch) -> None:
    import mlx.core as mx

    from mlx_parallm_provider.engine.kv import KVCacheManager
    from mlx_parallm_provider.engine.kv.storage import QUANTIZED_KV_BITS, PagedKVStorage
    from mlx_parallm_provider.models import backends

    if not _has_quantized_kernel():
        pytest.skip("no paged CPU kernel for quantized pools here")
    model = wide_head_model.model
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 40)]

    def logits(backend) -> list[mx.array]:
        kv = KVCacheManager(num_blocks=64, block_size=4)
        passes = PagedPieces(model, prompts, kv, PagedKVStorage(len(model.layers), kv.pool.num_blocks, 4, bits=QUANTIZED_KV_BITS[dtype]))
        with backends.using(model, backend):
            passes.run([0, 1, 2], 7)  # a right-padded prefill piece (several positions a row through the tables)
            passes.run([1, 2], 5)
            passes.decode_to_the_end()  # decode steps
        return [mx.concatenate(g) for g in passes.got]

    ran = paged_kernel_calls(monkeypatch)
    kernel = logits(backends.of(model))
    assert ran and all(r is not None for r in ran)  # every pass's attention through the kernel
    ran.clear()
    gathered = logits("mlx")
    assert not ran
    for ours, theirs in zip(kernel, gathered):
        assert mx.allclose(ours, theirs, atol=1e-4).item()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_rows_in_a_sliding_window_answer_as_alone(engine_of, dtype) -> None:
    """``max_kv_size``: every layer attends to its last 24 tokens and releases older blocks."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = _prompts(5)
    alone = engine_of(max_num_seqs=1, kv_cache_dtype=dtype, max_kv_size=24, enable_prefix_caching=False)
    expected = [alone.generate_sync(p, params).token_ids for p in prompts]
    engine = engine_of(kv_cache_dtype=dtype, max_kv_size=24, kv_block_size=8)
    assert asyncio.run(_together(engine, prompts, params)) == expected


def test_quantized_blocks_go_through_the_disk_tier(engine_of, tmp_path) -> None:
    """Codes, scales and biases are written and loaded together: a new engine answers from
    the disk as a cold one does."""
    prefix = [100 + j % 50 for j in range(100)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    first = engine_of(kv_cache_dtype="int4", kv_disk_path=str(tmp_path))
    first.generate_sync(prefix + [7], params)
    first.shutdown()
    second = engine_of(kv_cache_dtype="int4", kv_disk_path=str(tmp_path))
    got = second.generate_sync(prefix + [8], params)
    assert got.usage.cached_tokens == 96 and second.stats()["kv_disk"]["hits"] == 6
    cold = engine_of(kv_cache_dtype="int4", enable_prefix_caching=False).generate_sync(prefix + [8], params)
    assert got.token_ids == cold.token_ids
