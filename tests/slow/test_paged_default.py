"""Paged KV and prefix caching on the real embedded default model: the same tokens batched
as one at a time, and with prefix sharing on and off. One test (it replaces
test_prefix_caching_default.py), so the greedy burst on the default engine, which both
comparisons need, runs once."""

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
def test_paged_kv_and_prefix_sharing_give_each_prompts_tokens_alone_on_default_model() -> None:
    loaded = registry.load("default")
    layouts = {
        "paged": EngineConfig(prefill_chunk_size=256),  # the default layout, prefix caching on
        "paged, no sharing": EngineConfig(enable_prefix_caching=False, prefill_chunk_size=256),
        # One at a time, sharing prefixes as "paged" does: batched == alone is paged vs alone,
        # sharing on == off is paged vs "paged, no sharing" (both batched). Prefill without
        # sharing one prompt at a time would cost this test's longest burst twice over.
        "alone": EngineConfig(max_num_seqs=1, prefill_chunk_size=256),
        # A pool of ~1,400 tokens for ~5,000 wanted: requests wait for blocks at admission.
        "paged, small pool": EngineConfig(prefill_chunk_size=256, kv_cache_memory_gb=0.06),
    }
    engines = {name: Engine("default", config, loaded=loaded) for name, config in layouts.items()}
    try:
        prompts = _prompts(engines["paged"])
        assert len(prompts) >= 32

        async def burst(engine: Engine, params_for, which: range | list[int] = range(len(prompts))):
            return await asyncio.gather(*(engine.generate(prompts[i], params_for(i)) for i in which))

        # Greedy on every engine: batched == alone, and sharing on == off. Without sharing, every
        # prompt token is prefilled (~29 s for the ~8,800 here), so that engine answers a third
        # of each shared group and all the others (unshared, chunked, n > 1): ~4,000 tokens.
        which = {name: range(len(prompts)) for name in engines}
        which["paged, no sharing"] = [i for i in range(len(prompts)) if i % 3 == 0 or i >= 3 * len(QUESTIONS)]
        greedy = {name: asyncio.run(burst(engine, lambda i: SamplingParams(max_tokens=16), which[name])) for name, engine in engines.items()}
        tokens = {name: [c.token_ids for c in completions] for name, completions in greedy.items()}
        assert all(t == [tokens["alone"][i] for i in which[name]] for name, t in tokens.items())
        assert sum(c.usage.cached_tokens > 0 for c in greedy["paged"]) >= 24  # the prompts really shared prefixes
        assert engines["paged"].stats()["prefix_cache"]["hit_rate"] > 0.5

        # Seeded draws over the whole 49k vocabulary pick tail tokens whose perturbed scores
        # nearly tie, so float noise between batch shapes (logprobs differ by ~1e-5) flipped
        # about 1 draw in 600; the top 20 keep the draws random without the tail's near-ties.
        # Batched vs alone; the others greedy only, for CI time.
        seeded = lambda i: SamplingParams(max_tokens=16, temperature=0.8, seed=i, top_k=20)  # noqa: E731
        got = {name: [c.token_ids for c in asyncio.run(burst(engines[name], seeded))] for name in ("paged", "alone")}
        assert got["paged"] == got["alone"]
        assert engines["paged"].stats()["kv_cache"]["layout"] == "paged"
        small, whole = engines["paged, small pool"].stats(), engines["paged"].stats()
        assert small["kv_cache"]["kv_blocks_total"] < 100  # 0.06 GiB of 16-token blocks
        assert small["max_batch_size"] < whole["max_batch_size"]  # the pool, not max_num_seqs, bounded the batch
    finally:
        for engine in engines.values():
            engine.shutdown()
