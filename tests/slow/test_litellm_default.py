"""Each LiteLLM call path once against ``mlx-parallm/default`` (the embedded SmolLM2).

Small on purpose (max_tokens 16, batches of 4) so the module runs in well under a minute
on two CPU cores.
"""

from __future__ import annotations

import asyncio
from typing import Any

import litellm
import pytest

from fakes import chat_prompt
from mlx_parallm_provider import SamplingParams, get_engine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_litellm_engines")]

MODEL = "mlx-parallm/default"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRUITS = [[{"role": "user", "content": f"Name a fruit that is {colour}."}] for colour in ("red", "yellow", "green", "orange")]
TOKENS = 16


def content(response: Any) -> str:
    return response.choices[0].message.content


def joined(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_completion_answers_and_equals_engine_generate() -> None:
    response = litellm.completion(model=MODEL, messages=FRANCE, max_tokens=TOKENS)
    engine = get_engine("default")
    expected = engine.generate_sync(chat_prompt(engine, FRANCE), SamplingParams(max_tokens=TOKENS))
    assert "Paris" in content(response)
    assert content(response) == expected.text
    assert response.usage.completion_tokens == expected.usage.completion_tokens
    assert litellm.completion_cost(completion_response=response) == 0.0


def test_concurrent_acompletion_batches() -> None:
    async def all_at_once() -> list[Any]:
        return list(await asyncio.gather(*(litellm.acompletion(model=MODEL, messages=m, max_tokens=TOKENS) for m in FRUITS)))

    responses = asyncio.run(all_at_once())
    assert all(content(r) for r in responses)
    assert get_engine("default").stats()["max_batch_size"] >= 2


def test_batch_completion_batches() -> None:
    responses = litellm.batch_completion(model=MODEL, messages=FRUITS, max_tokens=TOKENS)
    assert all(content(r) for r in responses)
    assert get_engine("default").stats()["max_batch_size"] >= 2


def test_streaming_sync_and_async_join_to_the_completion() -> None:
    whole = content(litellm.completion(model=MODEL, messages=FRANCE, max_tokens=TOKENS))

    async def consume() -> list[Any]:
        stream = await litellm.acompletion(model=MODEL, messages=FRANCE, max_tokens=TOKENS, stream=True)
        return [chunk async for chunk in stream]

    assert joined(list(litellm.completion(model=MODEL, messages=FRANCE, max_tokens=TOKENS, stream=True))) == whole
    assert joined(asyncio.run(consume())) == whole


def test_text_completion_continues_the_raw_prompt() -> None:
    response = litellm.text_completion(model=MODEL, prompt="The capital of France is", max_tokens=8)
    assert "Paris" in response.choices[0].text
