"""What the LiteLLM layer costs: N concurrent ``litellm.acompletion`` calls versus the same
N rendered prompts through ``engine.generate``, in one run, on one shared engine.

Both sides are greedy with the same ``max_tokens`` and ``ignore_eos`` (so every request
generates exactly ``max_tokens`` tokens and both sides do the same work); their texts are
compared. Runs alternate (engine, LiteLLM, LiteLLM, engine, ...) to cancel drift, and the
cost is ``1 - litellm_tokens_per_s / engine_tokens_per_s`` over the median rates.

    python -m mlx_parallm_provider.bench.litellm_overhead [--model default] [--n 32] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

TOPICS = (
    "the sea", "mountains", "coffee", "the moon", "bicycles", "libraries", "rain", "volcanoes",
    "honey bees", "trains", "chess", "bread", "winter", "music", "deserts", "owls",
)


@dataclass
class Run:
    """One timed batch of N requests."""

    path: str  # "engine" or "litellm"
    seconds: float
    tokens: int
    max_batch: int
    texts: list[str]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def questions(n: int) -> list[list[dict[str, str]]]:
    """N distinct chat requests."""
    return [[{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]} (#{i})."}] for i in range(n)]


async def _engine_batch(engine: Any, prompts: Sequence[str], params: Any) -> tuple[int, list[str]]:
    done = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return sum(c.usage.completion_tokens for c in done), [c.text for c in done]


async def _litellm_batch(model: str, messages: Sequence[list[dict[str, str]]], max_tokens: int) -> tuple[int, list[str]]:
    import litellm

    calls = [
        litellm.acompletion(model=f"mlx-parallm/{model}", messages=m, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for m in messages
    ]
    done = await asyncio.gather(*calls)
    return sum(r.usage.completion_tokens for r in done), [r.choices[0].message.content for r in done]


async def _timed(path: str, engine: Any, batch: Callable[[], Awaitable[tuple[int, list[str]]]]) -> Run:
    engine.metrics.reset()
    tic = time.perf_counter()
    tokens, texts = await batch()
    seconds = time.perf_counter() - tic
    return Run(path, seconds, tokens, engine.stats()["max_batch_size"], texts)


async def measure(model: str, n: int, max_tokens: int, rounds: int) -> list[Run]:
    """Warm up, then ``rounds`` x (engine, LiteLLM, LiteLLM, engine) timed batches."""
    import litellm  # noqa: F401  (first, so the package's import hook registers the provider)

    from .. import SamplingParams, get_engine, register
    from ..chat import render_chat

    register()
    engine = get_engine(model)
    messages = questions(n)
    prompts = [render_chat(engine.tokenizer, m) for m in messages]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batches = {
        "engine": lambda: _engine_batch(engine, prompts, params),
        "litellm": lambda: _litellm_batch(model, messages, max_tokens),
    }
    # Warm-up at full width: the first batch of a new size compiles and allocates.
    await _engine_batch(engine, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    await _litellm_batch(model, messages, 8)
    runs = []
    for _ in range(rounds):
        for path in ("engine", "litellm", "litellm", "engine"):
            runs.append(await _timed(path, engine, batches[path]))
    return runs


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """Median tokens/s per path, the LiteLLM cost in percent, and whether the texts agree."""
    rate = {p: statistics.median(r.tokens_per_s for r in runs if r.path == p) for p in ("engine", "litellm")}
    texts = {tuple(r.texts) for r in runs}
    return {
        "engine_tokens_per_s": rate["engine"],
        "litellm_tokens_per_s": rate["litellm"],
        "litellm_cost_percent": 100.0 * (1.0 - rate["litellm"] / rate["engine"]),
        "same_texts": len(texts) == 1,
    }


def report(runs: Sequence[Run], model: str, n: int, max_tokens: int) -> None:
    """Print every run and the summary."""
    print(f"model={model} n={n} max_tokens={max_tokens} cpus={os.cpu_count()}")
    print(f"{'run':>3} {'path':<8} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'max batch':>9}")
    for i, r in enumerate(runs):
        print(f"{i:>3} {r.path:<8} {r.seconds:>8.2f} {r.tokens:>7} {r.tokens_per_s:>9.1f} {r.max_batch:>9}")
    s = summarize(runs)
    print(
        f"median: engine.generate {s['engine_tokens_per_s']:.1f} tokens/s | litellm.acompletion {s['litellm_tokens_per_s']:.1f} tokens/s | "
        f"LiteLLM layer cost: {s['litellm_cost_percent']:+.1f}% | same texts: {s['same_texts']}"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--n", type=int, default=32, help="concurrent requests per batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each round times engine, LiteLLM, LiteLLM, engine")
    args = parser.parse_args(argv)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    runs = asyncio.run(measure(args.model, args.n, args.max_tokens, args.rounds))
    report(runs, args.model, args.n, args.max_tokens)


if __name__ == "__main__":
    main()
