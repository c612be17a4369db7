"""The engine on paged KV: blocks follow the tokens held, preemption when they run out."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import mlx_lm_greedy
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.errors import InvalidParameterError

# The tiny llama: 2 layers x 2 KV heads x 16 dims, float32 K and V.
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _budget_gb(blocks: int, block_size: int) -> float:
    return blocks * block_size * BYTES_PER_TOKEN / 1024**3


def _prompts(n: int) -> list[list[int]]:
    return [[100 + (7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(n)]


def test_a_pool_too_small_for_the_batch_preempts_and_answers_every_request_the_same(make_engine) -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = _prompts(8)
    alone = make_engine(max_num_seqs=1)
    expected = [alone.generate_sync(p, params).token_ids for p in prompts]

    # 16 blocks of 8 tokens: each request needs up to 12 blocks alone, all 8 about 60.
    small = make_engine(kv_cache_memory_gb=_budget_gb(16, 8), kv_block_size=8, enable_prefix_caching=False)

    async def together():
        return await asyncio.gather(*(small.generate(p, params) for p in prompts))

    got = [c.token_ids for c in asyncio.run(together())]
    kv = small.stats()["kv_cache"]
    assert got == expected
    assert kv["layout"] == "paged" and kv["kv_blocks_total"] == 16
    assert kv["num_preemptions"] > 0  # the pool really ran out
    assert kv["kv_blocks_free"] == 16  # and every block came back


def test_streams_of_preempted_requests_carry_every_token(make_engine) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = _prompts(6)
    engine = make_engine(kv_cache_memory_gb=_budget_gb(10, 8), kv_block_size=8, enable_prefix_caching=False)

    async def stream(p):
        ids = []
        async for delta in engine.stream(p, params):
            ids.extend(delta.token_ids)
        return ids

    async def together():
        return await asyncio.gather(*(stream(p) for p in prompts))

    streamed = asyncio.run(together())
    assert engine.stats()["kv_cache"]["num_preemptions"] > 0
    assert [len(s) for s in streamed] == [20] * 6
    assert streamed == [engine.generate_sync(p, params).token_ids for p in prompts]


def test_a_request_larger_than_the_whole_pool_is_refused_at_submit(make_engine) -> None:
    engine = make_engine(kv_cache_memory_gb=_budget_gb(4, 8), kv_block_size=8)
    with pytest.raises(InvalidParameterError, match="kv_cache_memory_gb"):
        engine.generate_sync(list(range(100, 130)), SamplingParams(max_tokens=8))
    assert engine.generate_sync(list(range(100, 110)), SamplingParams(max_tokens=8)).token_ids


def test_one_long_prompt_among_short_ones_changes_no_ones_tokens(make_engine) -> None:
    params = SamplingParams(max_tokens=12)
    short = _prompts(6)
    long = [100 + j % 250 for j in range(400)]
    alone = make_engine(max_num_seqs=1)
    expected = [alone.generate_sync(p, params).token_ids for p in [long, *short]]
    engine = make_engine(prefill_chunk_size=64)

    async def together():
        return await asyncio.gather(*(engine.generate(p, params) for p in [long, *short]))

    assert [c.token_ids for c in asyncio.run(together())] == expected


def test_preempted_requests_recompute_from_their_own_cached_blocks(make_engine, monkeypatch) -> None:
    from mlx_parallm_provider.engine.runner import ModelRunner

    computed = []
    forward = ModelRunner.forward

    def counting(self, rows, pieces, starts, tokens=None, hidden=False):
        computed.append(sum(len(p) for p in pieces))
        return forward(self, rows, pieces, starts, tokens, hidden)

    monkeypatch.setattr(ModelRunner, "forward", counting)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = _prompts(8)
    expected = [make_engine(max_num_seqs=1, enable_prefix_caching=False).generate_sync(p, params).token_ids for p in prompts]
    runs = {}
    for caching in (False, True):
        computed.clear()
        engine = make_engine(kv_cache_memory_gb=_budget_gb(16, 8), kv_block_size=8, enable_prefix_caching=caching)

        async def together():
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

        assert [c.token_ids for c in asyncio.run(together())] == expected
        runs[caching] = (sum(computed), engine.stats()["kv_cache"]["num_preemptions"])
    assert runs[False][1] > 0 and runs[True][1] > 0
    # With caching, a preempted row's recompute starts from its own blocks while they last.
    assert runs[True][0] < runs[False][0]



def test_a_chunked_prompt_computes_logits_for_its_last_token_only(make_engine, monkeypatch) -> None:
    """The chunks' logits (chunk x vocabulary floats) are never computed, yet the answer is the
    one of an unchunked prefill: where the model splits at its head (the tiny llama does), the
    last chunk runs whole and its last position alone goes through the head; where it does
    not, the last chunk runs without its last token, then that token alone."""
    from mlx_parallm_provider.engine import runner
    from mlx_parallm_provider.engine.runner import ModelRunner

    params = SamplingParams(max_tokens=6)
    long = [100 + j % 250 for j in range(300)]
    expected = make_engine(prefill_chunk_size=4096, max_num_batched_tokens=4096).generate_sync(long, params).token_ids
    forward = ModelRunner.forward
    for split in (True, False):
        widths: list[tuple[int, bool]] = []

        def recording(self, rows, pieces, starts, tokens=None, hidden=False):
            widths.append((max(len(p) for p in pieces), hidden))
            return forward(self, rows, pieces, starts, tokens, hidden)

        monkeypatch.setattr(ModelRunner, "forward", recording)
        if not split:
            monkeypatch.setattr(runner, "split_head", lambda model: None)
        engine = make_engine(prefill_chunk_size=128, max_num_batched_tokens=128)
        assert engine.generate_sync(long, params).token_ids == expected
        assert (engine._core.runner.split is not None) == split
        assert engine.stats()["kv_cache"]["layout"] == "paged"
        chunks = [(128, False), (128, False), (44, True)] if split else [(128, False), (128, False), (43, False), (1, False)]
        assert widths[: len(chunks)] == chunks and len(widths) == len(chunks) + 5, widths  # then 5 decode steps


def test_without_a_budget_a_long_request_grows_the_arrays_to_about_its_own_need(make_engine) -> None:
    # Growth by a quarter alone would leave up to a quarter of the arrays unused past the long
    # row's prompt + max_tokens; capped at what the requests holding blocks can still use,
    # the arrays stop within a sixteenth of that (the least a growth adds).
    engine = make_engine(kv_block_size=8, prefill_chunk_size=64, enable_prefix_caching=False)
    short = SamplingParams(max_tokens=4, ignore_eos=True)

    async def shorts():
        return await asyncio.gather(*(engine.generate(p, short) for p in _prompts(6)))

    asyncio.run(shorts())
    storage = engine._core.runner.storage
    before = storage.physical_blocks
    long = [100 + j % 250 for j in range(440)]
    engine.generate_sync(long, SamplingParams(max_tokens=40, ignore_eos=True))  # 5 blocks while decoding
    need = -(-(len(long) + 40) // 8)  # its blocks: the short rows' are free again by then
    # (growth by a quarter alone: 71 blocks here, for the 61 it needs with the null block)
    assert need < storage.physical_blocks <= max(before, need + 1) * 17 // 16 + 1


def test_max_kv_size_on_blocks_answers_as_mlx_lm_rotating_caches_and_releases_blocks_that_left_the_window(tiny_model, make_engine) -> None:
    # Every layer attends to the last 32 tokens, as mlx-lm's rotating cache keeps them (none of the first);
    # on blocks, those older than every query's window go back to the pool while the row decodes.
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [p for p in _prompts(8) if len(p) < 60]  # some inside the window, some past it

    async def together(engine):
        return [c.token_ids for c in await asyncio.gather(*(engine.generate(p, params) for p in prompts))]

    paged = make_engine(max_kv_size=32, kv_block_size=8, enable_prefix_caching=False)
    assert asyncio.run(together(paged)) == mlx_lm_greedy(tiny_model, prompts, params, max_kv_size=32)
    one = make_engine(max_kv_size=32, kv_block_size=8, enable_prefix_caching=False)
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    assert one.generate_sync(_prompts(2)[1], long).token_ids == mlx_lm_greedy(tiny_model, _prompts(2)[1:2], long, max_kv_size=32)[0]
    # 14 + 300 tokens would take 40 blocks; a window of 32 straddles 5 at most, plus the
    # block being written (the pool hands the lowest free ids out first).
    assert one._core.kv.pool.high_water() <= 8
    assert one.stats()["kv_cache"]["kv_blocks_free"] == one.stats()["kv_cache"]["kv_blocks_total"]


def test_max_kv_size_on_blocks_serves_a_generation_longer_than_the_pool(make_engine) -> None:
    # 12 blocks of 8 tokens hold 96 tokens; a window of 32 needs ~6 of them at a time.
    engine = make_engine(max_kv_size=32, kv_block_size=8, kv_cache_memory_gb=_budget_gb(12, 8), enable_prefix_caching=False)
    done = engine.generate_sync(_prompts(1)[0], SamplingParams(max_tokens=200, ignore_eos=True))
    assert len(done.token_ids) == 200
    with pytest.raises(InvalidParameterError, match="kv_cache_memory_gb"):  # a prompt longer than the pool still is not
        engine.generate_sync([100 + j % 250 for j in range(120)], SamplingParams(max_tokens=4))


def test_prefix_caching_under_a_window_on_blocks_changes_no_tokens(make_engine) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    shared = [100 + j % 250 for j in range(70)]  # a prefix longer than the window
    prompts = [shared + [7 + i, 9, 11] for i in range(4)]
    off = make_engine(max_kv_size=48, kv_block_size=8, enable_prefix_caching=False)
    expected = [off.generate_sync(p, params).token_ids for p in prompts]
    on = make_engine(max_kv_size=48, kv_block_size=8)
    got = [on.generate_sync(p, params) for p in prompts]
    assert [c.token_ids for c in got] == expected
    assert all(c.usage.cached_tokens >= 64 for c in got[1:])  # the shared blocks, cached while they were held


def test_on_the_gather_path_rows_sharing_a_cached_prefix_answer_as_alone(make_engine, tiny_model, monkeypatch) -> None:
    # MLX's ops as the backend (as on Metal and CUDA): decode steps gather blocks, and rows
    # that share a cached system prompt attend to it as one cascade.
    from mlx_parallm_provider.engine.kv import paged_cache
    from mlx_parallm_provider.models import backends

    system = [100 + j % 250 for j in range(90)]
    prompts = [system + [7 + i] * (1 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with backends.using(tiny_model.model, "mlx"):
        alone = make_engine(max_num_seqs=1, kv_block_size=8)
        expected = [alone.generate_sync(p, params).token_ids for p in prompts]
        engine = make_engine(kv_block_size=8)
        engine.generate_sync(system + [1], SamplingParams(max_tokens=1))  # the system prompt's blocks, cached
        calls = []
        real = paged_cache.cascade_attention
        monkeypatch.setattr(paged_cache, "cascade_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = asyncio.run(_gather(engine, prompts, params))
    assert [c.token_ids for c in got] == expected
    assert calls and all(c.usage.cached_tokens >= 88 for c in got)


async def _gather(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


def test_a_state_space_model_is_refused_when_the_engine_is_built(smollm_tokenizer_dir, tmp_path) -> None:
    # Mamba's layers all keep a state (mlx-lm's ArraysCache), none attention KV (hybrid models,
    # served, have both): before, the first request killed the worker ('BatchKVCache' object
    # is not subscriptable, EngineDeadError).
    from conftest import TINY_CONFIG, write_tiny_model
    from mlx_parallm_provider.engine import Engine
    from mlx_parallm_provider.errors import UnsupportedModelError

    mamba = {"model_type": "mamba", "vocab_size": TINY_CONFIG["vocab_size"], "hidden_size": 64, "intermediate_size": 128,
             "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
             "time_step_rank": 8, "eos_token_id": TINY_CONFIG["eos_token_id"], "bos_token_id": TINY_CONFIG["bos_token_id"]}
    folder = write_tiny_model(tmp_path / "mamba", smollm_tokenizer_dir, config=mamba)
    with pytest.raises(UnsupportedModelError, match="mlx_lm.models.mamba has no attention layer"):
        Engine(str(folder))


def test_float16_kv_blocks_hold_half_the_bytes_and_batched_rows_answer_as_alone(make_engine) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [*_prompts(5), [100 + j % 250 for j in range(150)]]
    alone = make_engine(max_num_seqs=1, kv_cache_dtype="float16")
    expected = [alone.generate_sync(p, params).token_ids for p in prompts]
    engine = make_engine(kv_cache_dtype="float16", prefill_chunk_size=64)
    wide = make_engine()  # "auto": the tiny model's float32

    async def together(e):
        return await asyncio.gather(*(e.generate(p, params) for p in prompts))

    assert [c.token_ids for c in asyncio.run(together(engine))] == expected
    asyncio.run(together(wide))
    half, full = engine.stats()["kv_cache"], wide.stats()["kv_cache"]
    assert half["kv_cache_bytes"] * 2 == full["kv_cache_bytes"] > 0
    assert alone._kv_bytes_per_token * 2 == BYTES_PER_TOKEN  # noqa: SLF001 (what the pool is sized by)


def test_kv_cache_dtype_is_checked() -> None:
    from mlx_parallm_provider import EngineConfig

    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


def test_float16_kv_blocks_under_shared_prefixes_and_speculation_answer_as_alone(make_engine, monkeypatch) -> None:
    # Rows sharing cached prefix blocks decode through the cascade (blocks read back as float32);
    # n-gram drafts are verified by a multi-token forward over the gathered blocks.
    from mlx_parallm_provider.engine.drafting import ngram as speculation

    def draft(self, request) -> None:  # three tokens a step (mostly rejected: their KV rolled back)
        left = request.params.max_tokens - len(request.output_ids) - 1
        request.draft = [] if request.finished else list(request.prompt_ids[-3:])[: max(0, left)]

    monkeypatch.setattr(speculation.NgramProposer, "draft", draft)
    monkeypatch.setattr(speculation.NgramProposer, "plan", lambda self, rows: 3 if len(rows) <= self.max_batch and any(
        r.draft for r in rows) else 0)  # verify whatever the step costs
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prefix = [100 + j % 50 for j in range(40)]
    prompts = [prefix + [300 + i, 301 + i, 302 + i] * (1 + i % 3) for i in range(6)]
    alone = make_engine(max_num_seqs=1, kv_cache_dtype="float16", enable_prefix_caching=False)
    expected = [alone.generate_sync(p, params).token_ids for p in prompts]
    for config in ({}, {"speculative": "ngram", "speculative_max_batch": 8}):
        engine = make_engine(kv_cache_dtype="float16", **config)
        engine.generate_sync(prefix + [7], SamplingParams(max_tokens=2))  # the prefix cached first

        async def together():
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

        assert [c.token_ids for c in asyncio.run(together())] == expected, config
        stats = engine.stats()
        assert stats["cached_prompt_tokens"] >= 6 * 32  # the prefix's whole blocks, read from the cache
        if config:
            assert stats["speculation"]["draft_tokens"] > 0, stats["speculation"]


def test_a_batched_prefill_puts_each_rows_last_position_alone_through_the_head(make_engine, monkeypatch) -> None:
    """Where the model splits at its head, a prefill's rows run whole in one right-padded
    pass and only their last positions' hidden states reach the head: one row each, no
    separate pass of last tokens, and the answers of the rows run one at a time."""
    from mlx_parallm_provider.engine.runner import ModelRunner

    prompts = [[5 + j for j in range(n)] for n in (7, 19, 12)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    alone = [make_engine(enable_prefix_caching=False).generate_sync(p, params).token_ids for p in prompts]
    forward, passes, heads = ModelRunner.forward, [], []

    def recording(self, rows, pieces, starts, tokens=None, hidden=False):
        passes.append(([len(p) for p in pieces], hidden))
        out = forward(self, rows, pieces, starts, tokens, hidden)
        head = self.split.head
        if hidden and not getattr(head, "recorded", False):
            def counted(x):
                heads.append(x.shape[1])
                return head(x)
            counted.recorded = True
            self.split = type(self.split)(self.split.body, counted, self.split.vocab)
        return out

    monkeypatch.setattr(ModelRunner, "forward", recording)
    engine = make_engine(enable_prefix_caching=False, max_num_seqs=4)

    async def together():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    assert [c.token_ids for c in asyncio.run(together())] == alone
    # (The three usually prefill together; a worker that wakes between submissions splits them.)
    assert sorted(w for widths, hidden in passes if hidden for w in widths) == [7, 12, 19] and sum(heads) == 3, (passes, heads)
    assert all(set(widths) == {1} for widths, hidden in passes if not hidden)  # decode steps only: no column of last tokens
