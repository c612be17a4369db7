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

    def __init__(self, inner: Any, delay: float = 0.0, whole: str = "") -> None:
        self._inner, self.delay, self.encoded = inner, delay, 0
        self.whole_text, self.whole = whole, 0  # calls on exactly ``whole``

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded += 1
        self.whole += text == self.whole_text
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


class LengthsTokenizer(CountingTokenizer):
    """Also records the length of every text encoded."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.lengths: list[int] = []

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.lengths.append(len(text))
        return super().encode(text, **kwargs)


def test_a_text_over_the_context_by_far_is_refused_after_tokenizing_a_prefix_only(make_engine, monkeypatch) -> None:
    """A text whose length the vocabulary's longest entries could still fit (so far_over lets
    it by) but whose words are short: the 60,000-value enum the chat layer writes into a
    prompt took ~470,000 tokens to refuse, and 12 such requests held ~600 MB of the proxy."""
    from mlx_parallm_provider.engine.prompt_size import PREFIX_CHARS_PER_TOKEN

    engine = make_engine()
    tokenizer = LengthsTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)
    room = engine.context_length - 1
    words = " ".join(f"v{i}" for i in range(engine.context_length * 12))  # ~3 tokens a word
    assert not engine._prompts.far_over(words, 1)  # (noqa: SLF001) the length alone cannot refuse it
    for call in (lambda: engine.generate_sync(words, ONE), lambda: asyncio.run(engine.generate(words, ONE))):
        tokenizer.lengths.clear()
        with pytest.raises(ContextWindowExceededError, match="at least"):
            call()
        assert tokenizer.lengths and max(tokenizer.lengths) <= room * PREFIX_CHARS_PER_TOKEN < len(words)
    results = asyncio.run(engine.generate_many([words, "hi"], ONE, return_exceptions=True))
    assert isinstance(results[0], ContextWindowExceededError) and results[1].usage.completion_tokens == 1


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
    tokenizer = CountingTokenizer(engine.tokenizer, delay=0.6, whole=text)
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
    assert tokenizer.whole == 1  # once, even for n=3 (and a prefix once, this text being dense: see prefix_over)
    assert gap < 0.3, f"the loop stalled {gap:.2f} s while a prompt was tokenized"
