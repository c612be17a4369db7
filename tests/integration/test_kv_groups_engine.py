"""A model mixing sliding-window and global layers (gemma3) on paged KV: a table per group of
layers, the local groups' blocks released as they leave the window; tokens those of mlx-lm's
own greedy generation over its rotating caches."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, write_tiny_model
from engine_helpers import mlx_lm_greedy
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.engine.kv import groups as kv_groups
from mlx_parallm_provider.engine.kv.manager import blocks_for

WINDOW = 8
# Six layers, every third global: windows [8, 8, None] x 2 -> groups of 2 layers: two local, one global.
GEMMA3 = {**{k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                         "vocab_size", "bos_token_id", "eos_token_id")},
          "num_hidden_layers": 6, "model_type": "gemma3_text", "head_dim": TINY_CONFIG["head_dim"], "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": TINY_CONFIG["head_dim"],
          "sliding_window": WINDOW, "sliding_window_pattern": 3, "max_position_embeddings": 32768}
LONG = SamplingParams(max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from mlx_parallm_provider.models import registry

    return registry.load(str(write_tiny_model(tmp_path_factory.mktemp("gemma3-6"), smollm_tokenizer_dir, config=GEMMA3)))


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[1] + [rng.randrange(3, 1000) for _ in range(10 + 7 * i)] for i in range(n)]


def _windowed_kernel_calls(monkeypatch) -> list[bool]:
    """Whether each call of the paged kernel for a sliding-window layer ran it (not None)."""
    from mlx_parallm_provider.models import attention

    ran: list[bool] = []
    kernel = attention.paged_decode_attention

    def counted(*args, **kwargs):
        out = kernel(*args, **kwargs)
        if kwargs.get("window", args[8] if len(args) > 8 else None) is not None:
            ran.append(out is not None)
        return out

    monkeypatch.setattr(attention, "paged_decode_attention", counted)
    return ran


def _has_window_kernel(loaded) -> bool:
    from mlx_parallm_provider.models import backends, qmatmul_ext

    ext = qmatmul_ext.load()
    return backends.of(loaded.model).kernels and ext is not None and getattr(ext, "paged_windows", False)


def test_local_groups_release_their_blocks_and_tokens_match_mlx_lm(gemma3, monkeypatch) -> None:
    windowed = _windowed_kernel_calls(monkeypatch)
    engines = []

    def engine(**config) -> Engine:
        engines.append(Engine("gemma3", EngineConfig(kv_block_size=4, enable_prefix_caching=False, **config), loaded=gemma3))
        return engines[-1]

    try:
        prompts = _prompts(3)
        expected = mlx_lm_greedy(gemma3, prompts, LONG)
        grouped = engine()

        async def together(e: Engine) -> list[list[int]]:
            return [c.token_ids for c in await asyncio.gather(*(e.generate(p, LONG) for p in prompts))]

        assert asyncio.run(together(grouped)) == expected  # batched, on groups
        worker = grouped._core
        assert worker.runner.groups is not None and worker.kv.windows == [WINDOW, WINDOW, None]
        assert worker.runner.storage.num_layers == 2  # slots: a block holds two layers' K/V
        one = engine()
        assert one.generate_sync(prompts[2], LONG).token_ids == expected[2]  # alone
        # Its global table held every token; each local table a window's worth at most (and the
        # pool hands the lowest free blocks out first).
        total = len(prompts[2]) + LONG.max_tokens
        assert one._core.kv.pool.high_water() <= blocks_for(total, 4) + 2 * (blocks_for(WINDOW, 4) + 2) + 1
        grouped_bytes = one.stats()["kv_cache"]["kv_cache_bytes"]

        monkeypatch.setattr(kv_groups, "MAX_GROUPS", 1)  # one group: every layer holds every token
        single = engine()
        assert single.generate_sync(prompts[2], LONG).token_ids == expected[2]
        assert single._core.runner.groups is None and single._core.kv.windows == [None]
        assert grouped_bytes < 0.6 * single.stats()["kv_cache"]["kv_cache_bytes"]
        if _has_window_kernel(gemma3):  # the local layers' prefill and decode went through the block tables
            assert windowed and all(windowed)
    finally:
        for e in engines:
            e.shutdown()


@pytest.mark.parametrize("config", [
    {"max_kv_size": 16},  # every layer windowed, two window sizes: groups of windows 8, 8 and 16
    {"speculative": "ngram", "speculative_max_batch": 8},  # rejected drafts' blocks given back in every group
])
def test_grouped_tables_answer_as_mlx_lm_with_windows_everywhere_or_speculation(gemma3, config, monkeypatch) -> None:
    from mlx_parallm_provider.engine.drafting import ngram as speculation

    prompts = _prompts(3)
    expected = mlx_lm_greedy(gemma3, prompts, LONG, config.get("max_kv_size"))
    engines = [Engine("gemma3", EngineConfig(kv_block_size=4, **config), loaded=gemma3)]
    try:
        paged = engines[0]
        if "speculative" in config:
            # The random model never repeats itself: draft its true next tokens, the third one
            # wrong, so every step accepts two, rejects one and gives its blocks back.
            truth = {tuple(p): t for p, t in zip(prompts, expected)}

            def oracle(self, request) -> None:
                known, n = truth[tuple(request.prompt_ids)], len(request.output_ids)
                draft = list(known[n : n + min(3, request.params.max_tokens - n - 1)])
                if len(draft) == 3:
                    draft[2] = (draft[2] + 1) % 1000
                request.draft = draft

            monkeypatch.setattr(speculation.NgramProposer, "draft", oracle)
            monkeypatch.setattr(speculation.NgramProposer, "plan", lambda self, rows: max((len(r.draft) for r in rows), default=0))

        async def together() -> list[list[int]]:
            return [c.token_ids for c in await asyncio.gather(*(paged.generate(p, LONG) for p in prompts))]

        assert asyncio.run(together()) == expected
        assert [paged.generate_sync(p, LONG).token_ids for p in prompts] == expected
        assert len(paged._core.kv.windows) == 3
        if "speculative" in config:
            stats = paged.stats()["speculation"]
            assert stats["draft_tokens"] > 100 and 0.5 < stats["acceptance_rate"] < 1.0, stats
    finally:
        for e in engines:
            e.shutdown()


def test_prefix_caching_on_a_grouped_model_changes_no_tokens(gemma3) -> None:
    shared = [1] + [100 + j % 250 for j in range(60)]  # longer than the window: local groups hold its end only
    prompts = [shared + [7 + i, 9, 11] for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    off = Engine("gemma3", EngineConfig(kv_block_size=4, enable_prefix_caching=False), loaded=gemma3)
    on = Engine("gemma3", EngineConfig(kv_block_size=4), loaded=gemma3)
    try:
        expected = [off.generate_sync(p, params).token_ids for p in prompts]
        got = [on.generate_sync(p, params) for p in prompts]
        assert [c.token_ids for c in got] == expected
        assert all(c.usage.cached_tokens >= 56 for c in got[1:])  # whole shared blocks, from every group
    finally:
        off.shutdown()
        on.shutdown()
