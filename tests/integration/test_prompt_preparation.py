"""Nothing heavy on a caller's loop (issue 21, item 4): a text far over the context is
refused from its length, without tokenizing it; long texts of async callers are tokenized
on a thread, so the other coroutines of the loop keep running."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from engine_helpers import max_gap_while

from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine.prompt_size import INLINE_PROMPT_CHARS
from mlx_parallm_provider.errors import ContextWindowExceededError

ONE = SamplingParams(max_tokens=1)


class CountingTokenizer:
    """The engine's tokenizer, counting ``encode`` calls; ``delay`` seconds of blocking sleep
    in each call on a long text stands for a slow tokenization."""

    def __init__(self, inner: Any, delay: float = 0.0) -> None:
        self._inner, self.delay, self.encoded = inner, delay, 0

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded += 1
        if len(text) > INLINE_PROMPT_CHARS:
            time.sleep(self.delay)
        return self._inner.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def densest_text(tokenizer: Any, tokens: int) -> str:
    """About ``tokens`` tokens of the text with the most characters per token this
    vocabulary offers (one of its longest entries, repeated)."""
    def per_token(text: str) -> float:
        return len(text) / len(tokenizer.encode(text, add_special_tokens=False))

    longest = sorted(tokenizer.get_vocab(), key=len)[-20:]
    piece = max((tokenizer.convert_tokens_to_string([t]) * 4 for t in longest), key=per_token)
    return piece * int(tokens * per_token(piece) // len(piece))


@pytest.fixture
def counted(make_engine, monkeypatch):
    engine = make_engine()
    tokenizer = CountingTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)
    return engine, tokenizer


def test_a_text_far_over_the_context_is_refused_without_tokenizing(counted) -> None:
    engine, tokenizer = counted
    huge = "x" * 10_000_000  # the 10 MB message that took 13 s to refuse
    with pytest.raises(ContextWindowExceededError, match="at least"):
        engine.generate_sync(huge, ONE)
    with pytest.raises(ContextWindowExceededError):
        asyncio.run(engine.generate(huge, ONE))
    results = asyncio.run(engine.generate_many([huge, "hi"], ONE, return_exceptions=True))
    assert isinstance(results[0], ContextWindowExceededError) and results[1].usage.completion_tokens == 1
    assert tokenizer.encoded == 1  # "hi" only
    with pytest.raises(ContextWindowExceededError):
        engine.generate_sync(list(range(engine.context_length)), ONE)  # ids: counted, not checked one by one


def test_the_densest_text_that_fits_is_not_refused_from_its_length(counted) -> None:
    engine, tokenizer = counted
    text = densest_text(engine.tokenizer, engine.context_length - 8)
    assert len(text) > engine.context_length * 8 and len(engine.encode(text)) + 1 <= engine.context_length
    assert engine.generate_sync(text, ONE).usage.completion_tokens == 1
    assert asyncio.run(engine.generate(text, ONE)).usage.completion_tokens == 1


@pytest.mark.parametrize("door", ["generate", "stream", "generate_many"])
def test_a_slow_tokenization_does_not_stall_the_callers_loop(make_engine, monkeypatch, door: str) -> None:
    engine = make_engine()
    text = densest_text(engine.tokenizer, 200)
    assert len(text) > INLINE_PROMPT_CHARS
    tokenizer = CountingTokenizer(engine.tokenizer, delay=0.6)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)

    async def work() -> None:
        if door == "generate":
            await engine.generate(text, ONE)
        elif door == "stream":
            async for _ in engine.stream(text, ONE):
                pass
        else:
            await engine.generate_many([text], ONE, n=3)

    gap = asyncio.run(max_gap_while(work()))
    assert tokenizer.encoded == 1  # once, even for n=3
    assert gap < 0.3, f"the loop stalled {gap:.2f} s while a prompt was tokenized"
