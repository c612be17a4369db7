"""The async front doors prepare a request (chat template, tools, grammar) off the caller's
event loop, so one slow preparation never stalls the loop's other coroutines (issue 21,
item 4)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import litellm
import pytest

from engine_helpers import max_gap_while
from fakes import FakeEngine, make_tokenizer, patch_get_engine
from mlx_parallm_provider.integrations import litellm as adapter
from mlx_parallm_provider.integrations.langchain import chat as langchain_chat
from mlx_parallm_provider.langchain import ChatMLXParallm

HI = [{"role": "user", "content": "Hi"}]
DELAY = 1.2  # a stall it causes is this long; LiteLLM's own per-call loop work took up to 0.31 s on a busy 2-core machine


class SlowTemplate:
    """A tokenizer whose chat template takes ``DELAY`` seconds (blocking) to render."""

    def __init__(self) -> None:
        self._inner = make_tokenizer()
        self.rendered = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(DELAY)
        self.rendered += 1
        return self._inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    adapter.register()
    fake = FakeEngine("Hello.", tokenizer=SlowTemplate())
    patch_get_engine(monkeypatch, fake)
    monkeypatch.setattr(langchain_chat, "engine_for", lambda model: fake)
    return fake


async def _litellm(stream: bool) -> None:
    response = await litellm.acompletion(model="mlx-parallm/fake", messages=HI, stream=stream)
    if stream:
        async for _ in response:
            pass


async def _langchain(stream: bool) -> None:
    model = ChatMLXParallm(model="fake")
    if stream:
        async for _ in model.astream("Hi"):
            pass
    else:
        await model.ainvoke("Hi")


@pytest.mark.parametrize("door", [_litellm, _langchain], ids=["litellm", "langchain"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_slow_preparation_does_not_stall_the_callers_loop(engine: FakeEngine, door: Any, stream: bool) -> None:
    gap = asyncio.run(max_gap_while(door(stream)))
    assert engine.tokenizer.rendered >= 1 and engine.calls  # prepared, then submitted
    assert gap < DELAY / 2, f"the loop stalled {gap:.2f} s while a request was prepared"
