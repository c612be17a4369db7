"""A model mixing sliding-window and global layers (gemma3) on paged KV: a table per group of
layers, the local groups' blocks released as they leave the window; tokens unchanged."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.engine.kv import groups as kv_groups
from mlx_parallm_provider.engine.kv.manager import blocks_for

from conftest import TINY_CONFIG, write_tiny_model

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


def test_local_groups_release_their_blocks_and_tokens_match_the_rectangle(gemma3, monkeypatch) -> None:
    engines = []

    def engine(**config) -> Engine:
        engines.append(Engine("gemma3", EngineConfig(kv_block_size=4, enable_prefix_caching=False, **config), loaded=gemma3))
        return engines[-1]

    try:
        prompts = _prompts(3)
        rectangle = engine(kv_layout="rectangle")
        expected = [rectangle.generate_sync(p, LONG).token_ids for p in prompts]
        grouped = engine()

        async def together(e: Engine) -> list[list[int]]:
            return [c.token_ids for c in await asyncio.gather(*(e.generate(p, LONG) for p in prompts))]

        assert asyncio.run(together(grouped)) == expected  # batched, on groups
        worker = grouped._worker
        assert worker.paged.groups is not None and worker.kv.windows == [WINDOW, WINDOW, None]
        assert worker.paged.storage.num_layers == 2  # slots: a block holds two layers' K/V
        one = engine()
        assert one.generate_sync(prompts[2], LONG).token_ids == expected[2]  # alone
        # Its global table held every token; each local table a window's worth at most (and the
        # pool hands the lowest free blocks out first).
        total = len(prompts[2]) + LONG.max_tokens
        assert one._worker.kv.pool.high_water() <= blocks_for(total, 4) + 2 * (blocks_for(WINDOW, 4) + 2) + 1
        grouped_bytes = one.stats()["kv_cache"]["kv_cache_bytes"]

        monkeypatch.setattr(kv_groups, "MAX_GROUPS", 1)  # one group: every layer holds every token
        single = engine()
        assert single.generate_sync(prompts[2], LONG).token_ids == expected[2]
        assert single._worker.paged.groups is None and single._worker.kv.windows == [None]
        assert grouped_bytes < 0.6 * single.stats()["kv_cache"]["kv_cache_bytes"]
    finally:
        for e in engines:
            e.shutdown()
