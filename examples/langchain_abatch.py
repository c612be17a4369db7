"""A LangChain prompt-template chain over 32 inputs: one at a time, then with ``abatch``.

``abatch`` runs the 32 chain calls concurrently; ChatMLXParallm hands each one to the
shared engine, which decodes them as one batch. The one-at-a-time run awaits each call
before starting the next, so the engine never has more than one request.

Run: python examples/langchain_abatch.py [--n 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from mlx_parallm_provider import get_engine, shutdown_engines
from mlx_parallm_provider.langchain import ChatMLXParallm

ANIMALS = [
    "cat", "dog", "owl", "whale", "ant", "horse", "eagle", "shark", "frog", "bee", "wolf", "fox",
    "bear", "lion", "tiger", "otter", "crow", "seal", "goat", "duck", "moose", "panda", "koala",
    "camel", "zebra", "snail", "parrot", "rabbit", "salmon", "spider", "turtle", "penguin",
]


async def main(n: int, max_tokens: int) -> None:
    chat = ChatMLXParallm(model="default", max_tokens=max_tokens, temperature=0.0)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You answer in one short sentence."), ("user", "Tell me one fact about the {animal}.")]
    )
    chain = prompt | chat | StrOutputParser()
    inputs = [{"animal": ANIMALS[i % len(ANIMALS)]} for i in range(n)]
    engine = get_engine("default")  # loads (and on first use converts) the model up front

    tic = time.perf_counter()
    one_by_one = [await chain.ainvoke(x) for x in inputs]
    sequential_s = time.perf_counter() - tic
    sequential_batch = engine.stats()["max_batch_size"]

    tic = time.perf_counter()
    batched = await chain.abatch(inputs, config={"max_concurrency": n})
    batched_s = time.perf_counter() - tic

    for x, answer in list(zip(inputs, batched))[:4]:
        print(f"{x['animal']:>8}: {answer.strip()}")
    print("...")
    print(f"one at a time: {sequential_s:6.1f} s  (max decode batch {sequential_batch})")
    print(f"abatch:        {batched_s:6.1f} s  (max decode batch {engine.stats()['max_batch_size']})")
    print(f"speed-up: {sequential_s / batched_s:.1f}x for {n} calls of up to {max_tokens} tokens")
    print(f"identical answers: {sum(a == b for a, b in zip(one_by_one, batched))}/{n}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="number of chain inputs")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        asyncio.run(main(args.n, args.max_tokens))
    finally:
        shutdown_engines()
