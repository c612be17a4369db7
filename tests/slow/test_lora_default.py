"""LoRA adapters on the real default model (quantized, on the CPU: the packed kernels and the
fused one-op layer step for rows without an adapter): a batch mixing two adapters and none
answers as mlx-lm does with each adapter alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_helpers import mlx_lm_greedy_with_adapter, write_random_adapter
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.models import registry

pytestmark = pytest.mark.slow


def test_mixed_adapters_on_the_default_model_answer_as_mlx_lm_alone(tmp_path: Path) -> None:
    loaded = registry.load("default")
    adapters = [write_random_adapter(tmp_path / f"a{i}", loaded.path, num_layers=16, seed=i, b_std=0.02) for i in (1, 2)]
    engine = Engine("default", EngineConfig(max_num_seqs=6, batch_window_ms=200), loaded=loaded)
    try:
        prompts = [engine.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time",
                                              "List three colours:", "1, 2, 3, 4,", "Hello! How are")]
        for adapter in adapters:  # (resident before the batch, so all six arrive within the window)
            engine.generate_sync(prompts[0], SamplingParams(max_tokens=1, lora=str(adapter)))
        choice = [None, adapters[0], adapters[1]] * 2
        params = [SamplingParams(max_tokens=12, ignore_eos=True, lora=None if a is None else str(a)) for a in choice]
        got = [c.token_ids for c in engine.generate_many_sync(prompts, params)]
        assert engine.stats()["max_batch_size"] == 6
    finally:
        engine.shutdown()
    for row, (adapter, prompt) in enumerate(zip(choice, prompts)):
        assert got[row] == mlx_lm_greedy_with_adapter(loaded.path, adapter, [prompt], 12)[0], f"row {row}"
