"""The embedded default model, converted from its GGUF, answers correctly."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_default_model_knows_paris() -> None:
    import mlx_lm

    from mlx_parallm_provider.models import registry

    loaded = registry.load("default")
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    answer = mlx_lm.generate(loaded.model, loaded.tokenizer, prompt, max_tokens=24)
    assert "Paris" in answer


@pytest.mark.slow
def test_default_model_quantized_and_dequantized_agree() -> None:
    import mlx.core as mx

    from mlx_parallm_provider.models import registry

    f32 = registry.load("default", dequantize=True)
    q = registry.load("default", dequantize=False)
    ids = mx.array([f32.tokenizer.encode("The capital of France is", add_special_tokens=False)])
    assert mx.argmax(f32.model(ids)[0, -1]).item() == mx.argmax(q.model(ids)[0, -1]).item()
