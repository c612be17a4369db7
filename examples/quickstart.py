"""16 questions to the embedded default model through LiteLLM: all at once, then one at a time.

The 16 concurrent ``litellm.acompletion`` calls are decoded together as one batch by the
shared engine; the same 16 calls awaited one after another decode alone. Both runs are
greedy, so they give the same answers; the difference is aggregate tokens per second.

Run: ./scripts/quickstart.sh   (or: python examples/quickstart.py)
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

# LiteLLM's bundled model cost map, so importing it makes no download attempt (which prints
# warnings and retries for seconds on a machine without internet access).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402

import mlx_parallm_provider  # noqa: E402, F401  (registers the provider with LiteLLM)
from mlx_parallm_provider import get_engine  # noqa: E402

MODEL = "mlx-parallm/default"
MAX_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Why is the sky blue?",
    "What do bees make?",
    "Name a planet in our solar system.",
    "What language is spoken in Brazil?",
    "How many days are in a week?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest ocean on Earth?",
    "Give me a synonym for happy.",
    "What gas do plants absorb from the air?",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Name a fruit that is yellow.",
]


def ask(question: str) -> Any:
    """One chat completion call (a coroutine), greedy, at most MAX_TOKENS tokens."""
    return litellm.acompletion(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0)


async def all_at_once() -> list[Any]:
    """The 16 calls concurrently: the engine decodes them as one batch."""
    return list(await asyncio.gather(*(ask(q) for q in QUESTIONS)))


async def one_at_a_time() -> list[Any]:
    """The same 16 calls, each awaited before the next starts."""
    return [await ask(q) for q in QUESTIONS]


async def timed(run: Any) -> tuple[list[Any], float, float]:
    """Run a batch of calls; return the responses, seconds taken and output tokens/s."""
    tic = time.perf_counter()
    responses = await run()
    seconds = time.perf_counter() - tic
    tokens = sum(r.usage.completion_tokens for r in responses)
    return responses, seconds, tokens / seconds


async def main() -> None:
    tic = time.perf_counter()
    engine = get_engine("default")
    await ask("Hello!")  # warm-up: the first call compiles and allocates
    print(f"loaded {engine.model_name} and warmed up in {time.perf_counter() - tic:.1f}s\n")

    together, t_together, rate_together = await timed(all_at_once)
    for question, response in zip(QUESTIONS, together):
        print(f"Q: {question}\nA: {response.choices[0].message.content.strip()}\n")
    batch = engine.stats()["max_batch_size"]
    alone, t_alone, rate_alone = await timed(one_at_a_time)

    same = [r.choices[0].message.content for r in together] == [r.choices[0].message.content for r in alone]
    print(f"16 concurrent acompletion calls: {t_together:6.1f}s  {rate_together:6.1f} tokens/s  (largest decode batch: {batch})")
    print(f"16 calls one at a time:          {t_alone:6.1f}s  {rate_alone:6.1f} tokens/s")
    print(f"speed-up: {rate_together / rate_alone:.1f}x   same answers: {same}")


if __name__ == "__main__":
    asyncio.run(main())
