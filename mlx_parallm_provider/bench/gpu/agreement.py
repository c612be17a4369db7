"""Greedy agreement of the batched engine with mlx-lm's own generation, and the prompts the
GPU checks send."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..lora import mlx_lm_greedy

PROMPTS = [
    "Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.", "Explain recursion briefly.",
    "Translate 'good morning' to Spanish.", "Give me a name for a cat.", "What is 17 times 23?", "Describe a rainbow in one line.",
]


def prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` short prompts' token ids, all different (:data:`PROMPTS` in turn, lengthened on each round)."""
    return [tokenizer.encode(PROMPTS[i % len(PROMPTS)] + (" Again." * (i // len(PROMPTS)))) for i in range(n)]


def agreement(model: str, prompts: int = 8, tokens: int = 32) -> dict[str, Any]:
    """Greedy tokens of the engine (all ``prompts`` in one batch) against mlx-lm's
    ``generate_step`` on each prompt alone (its own load of the model)."""
    from ...config import EngineConfig
    from ...engine import Engine, SamplingParams
    from ...models import registry

    loaded = registry.load(model)
    ids = prompt_ids(loaded.tokenizer, prompts)
    engine = Engine("agreement", EngineConfig(max_num_seqs=max(prompts, 1)), loaded=loaded)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        batched = [o.token_ids for o in engine.generate_many_sync(ids, params)]
        batch_size = engine.stats()["max_batch_size"]
    finally:
        engine.shutdown()
    alone = mlx_lm_greedy(Path(model), None, ids, tokens)
    prefixes = []
    for a, b in zip(batched, alone):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same)
    return {"model": model, "rows": prompts, "tokens": tokens, "batch_size": batch_size,
            "rows_identical": sum(a == b for a, b in zip(batched, alone)), "agreeing_prefix": prefixes}
