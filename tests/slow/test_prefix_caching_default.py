"""Prefix caching on the real embedded default model: the same tokens with sharing on and off."""

from __future__ import annotations

import asyncio

import pytest

from mlx_parallm_provider.chat import render_chat
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.models import registry

RULES = [
    "Answer in one short sentence.", "Use plain words.", "Never invent facts.", "Prefer metric units.",
    "If unsure, say so.", "Do not use emojis.", "Be polite.", "Name your sources when you can.",
]
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "What do bees make?",
    "Who wrote Hamlet?", "What is water made of?", "How many legs does a spider have?", "What season comes after winter?",
]


def _system(n_rules: int) -> str:
    return "You are a careful assistant. " + " ".join(RULES[i % len(RULES)] + f" (rule {i})" for i in range(n_rules))


def _prompts(engine: Engine) -> list[str]:
    chat = lambda system, q: render_chat(  # noqa: E731
        engine.tokenizer, ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
    )
    prompts = []
    for n_rules in (6, 20, 45):  # shared system prompts of about 90, 250 and 520 tokens
        prompts += [chat(_system(n_rules), q) for q in QUESTIONS]
    prompts += [chat(None, q + " Thanks.") for q in QUESTIONS[:4]]  # unshared beyond the template
    prompts += [chat(_system(60)[::-1], "Summarise the rules above.")]  # long, unshared: chunked
    prompts += [chat(_system(20), "Tell me a joke.")] * 4  # n > 1
    return prompts


@pytest.mark.slow
def test_outputs_identical_with_sharing_on_and_off_on_default_model() -> None:
    loaded = registry.load("default")
    engines = {on: Engine("default", EngineConfig(enable_prefix_caching=on, prefill_chunk_size=256), loaded=loaded) for on in (False, True)}
    try:
        prompts = _prompts(engines[True])
        assert len(prompts) >= 32

        async def burst(engine: Engine, params_for):
            return await asyncio.gather(*(engine.generate(p, params_for(i)) for i, p in enumerate(prompts)))

        # Greedy only here, for CI time: seeded draws with sharing on and off are compared in
        # test_paged_default.py (the paged layout shares prefixes, the rectangle run there does not).
        for params_for in (lambda i: SamplingParams(max_tokens=16),):
            off = asyncio.run(burst(engines[False], params_for))
            on = asyncio.run(burst(engines[True], params_for))
            assert [c.token_ids for c in on] == [c.token_ids for c in off]
        assert sum(c.usage.cached_tokens > 0 for c in on) >= 24
        assert engines[True].stats()["prefix_cache"]["hit_rate"] > 0.5
    finally:
        for engine in engines.values():
            engine.shutdown()
