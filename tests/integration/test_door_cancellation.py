"""Issue 8: cancellation reaches the engine through every door. A LangChain ``abatch``
cancelled mid-run and a LiteLLM call whose ``timeout`` expires free their batch rows at
once instead of decoding tokens nobody will read. (The proxy's hung-up HTTP clients are
tested in test_litellm_proxy.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

import litellm
import pytest

from engine_helpers import TokenCostModel
from mlx_parallm_provider.engine import Engine, SamplingParams, shutdown_engines
from mlx_parallm_provider.engine import api as coordinator
from mlx_parallm_provider.langchain import ChatMLXParallm
from mlx_parallm_provider.models.registry import LoadedModel

NAME = "slow-tiny"
ROWS, MAX_TOKENS = 8, 400


@pytest.fixture
def slow_engine(tiny_model: LoadedModel) -> Iterator[tuple[Engine, TokenCostModel]]:
    """The shared engine every door finds under NAME: the tiny model at 2 ms per token."""
    model = TokenCostModel(tiny_model.model, seconds_per_token=0.002)
    engine = Engine(NAME, loaded=LoadedModel(tiny_model.name, tiny_model.path, model, tiny_model.tokenizer, tiny_model.config))
    shutdown_engines()
    coordinator._engines[NAME] = engine
    yield engine, model
    shutdown_engines()


def _wait_until(condition: Any, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _assert_rows_freed(engine: Engine, model: TokenCostModel) -> None:
    assert _wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, 5)
    settled = model.tokens
    time.sleep(0.3)
    assert model.tokens == settled, "the engine kept computing after the rows were freed"
    # Uncancelled, the rows would have decoded ROWS x MAX_TOKENS tokens.
    assert engine.stats()["generated_tokens"] < ROWS * MAX_TOKENS // 4


def test_cancelling_a_langchain_abatch_frees_its_rows(slow_engine) -> None:
    engine, model = slow_engine
    chat = ChatMLXParallm(model=NAME, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def cancel_mid_run() -> None:
        task = asyncio.ensure_future(chat.abatch([f"Tell story number {i}." for i in range(ROWS)]))
        while engine.stats()["running"] < ROWS:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancel_mid_run(), 60))
    _assert_rows_freed(engine, model)


def test_a_litellm_timeout_frees_the_rows(slow_engine) -> None:
    import mlx_parallm_provider

    mlx_parallm_provider.register()
    engine, model = slow_engine

    async def time_out() -> list[Any]:
        calls = [litellm.acompletion(model=f"mlx-parallm/{NAME}", messages=[{"role": "user", "content": f"Story {i}"}],
                                     max_tokens=MAX_TOKENS, ignore_eos=True, timeout=0.5) for i in range(ROWS)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(time_out(), 60))
    assert all(isinstance(r, litellm.Timeout) for r in results), results
    _assert_rows_freed(engine, model)


@pytest.mark.parametrize("call", ["generate", "generate_many", "stream"])
def test_closing_the_callers_loop_frees_its_rows(slow_engine, call: str) -> None:
    """Issue 21 item 17: requests of an event loop closed before they finished (their tasks
    never to run again) are dropped, not decoded to max_tokens for nobody."""
    engine, model = slow_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [f"Tell story number {i}." for i in range(ROWS)]

    async def start() -> None:
        if call == "generate_many":
            asyncio.ensure_future(engine.generate_many(prompts, params))
        for prompt in prompts if call != "generate_many" else []:
            if call == "generate":
                asyncio.ensure_future(engine.generate(prompt, params))
            else:
                asyncio.ensure_future(anext(engine.stream(prompt, params)))
        while engine.stats()["running"] < ROWS:
            await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start())
    loop.close()  # the tasks are still pending: nobody will ever read their results
    _assert_rows_freed(engine, model)
