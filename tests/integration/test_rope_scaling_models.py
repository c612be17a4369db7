"""Models whose RoPE builds its frequency table lazily at construction (Llama 3 ``llama3``,
Phi-3.5 / Phi-4-mini ``longrope``, YaRN) serve requests on the worker thread, and their
greedy output is mlx-lm's own.

Those tables are plain arrays, not parameters, so loading must evaluate them on the loading
thread; otherwise the worker meets an array of another thread's stream
("There is no Stream(cpu, 0) in current thread").

Phi-3.5's longrope and gpt-oss's YaRN run in the architecture matrix
(``test_architecture_matrix.py``: ``phi3_longrope``, ``gpt_oss``), loaded the same way and
checked against mlx-lm's greedy output there, with its other checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY_CONFIG, write_tiny_model
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams

HEAD_DIM = TINY_CONFIG["head_dim"]

CONFIGS = {
    "llama3": {
        **TINY_CONFIG,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3_yarn": {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
        "vocab_size": 49152, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
}


def mlx_lm_greedy(folder: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation on a separately loaded copy of the folder."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(folder))
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_lazy_rope_tables_serve_on_the_worker_as_mlx_lm_does(name: str, tmp_path: Path, smollm_tokenizer_dir: Path) -> None:
    from mlx_parallm_provider.models import registry

    folder = write_tiny_model(tmp_path / name, smollm_tokenizer_dir, config=CONFIGS[name])
    loaded = registry.load(str(folder))  # on this thread; the engine computes on its worker
    engine = Engine(name, EngineConfig(), loaded=loaded)
    try:
        prompt_ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got = engine.generate_sync(prompt_ids, params).token_ids
        assert engine.generate_sync(prompt_ids, params).token_ids == got  # a second request, same worker
    finally:
        engine.shutdown()
    assert got == mlx_lm_greedy(folder, prompt_ids, 10)
