"""Fuzz the LangChain door: any model fields and messages either answer or raise a typed
error (the package's, pydantic's validation error, or LangChain's own refusal of a message
it cannot convert), and innocent calls beside them are unharmed."""

from __future__ import annotations

import asyncio
import traceback

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from langchain_core.exceptions import LangChainException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import ValidationError

from fuzzing import PLAUSIBLE, junk, mostly, run
from mlx_parallm_provider.errors import MLXParallmError
from mlx_parallm_provider.langchain import ChatMLXParallm, MLXParallmLLM

text = st.text(max_size=30)
lc_message = st.one_of(
    text.map(HumanMessage), text.map(SystemMessage), text.map(AIMessage),
    st.builds(lambda c, i: ToolMessage(content=c, tool_call_id=i), text, st.sampled_from(["call_1", "zzz"])),
    st.builds(lambda c: AIMessage(content=c, tool_calls=[{"name": "get_weather", "args": {"city": "Oslo"}, "id": "call_1"}]), text),
    st.tuples(st.sampled_from(["human", "user", "system", "ai", "assistant", "bogus"]), text),
    st.fixed_dictionaries({"content": text}, optional={"role": st.sampled_from(["user", "system", "bogus"])}),
    text,
    junk,
)
chat_input = mostly(text | st.lists(text.map(HumanMessage), min_size=1, max_size=2), st.lists(lc_message, max_size=4) | junk)
fields = st.sets(st.sampled_from(sorted(PLAUSIBLE)), max_size=4).flatmap(
    lambda names: st.fixed_dictionaries({n: PLAUSIBLE[n] for n in names})
)
INNOCENT = ["Name a colour.", "Name a city."]


def _typed(error: BaseException) -> bool:
    """The package's errors, pydantic validation, LangChain's exceptions, or a ValueError /
    TypeError / NotImplementedError raised by langchain_core itself refusing an input."""
    if isinstance(error, (MLXParallmError, ValidationError, LangChainException)):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, (ValueError, TypeError, NotImplementedError)) and bool(frames) and "langchain_core" in frames[-1].filename


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    chat = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=6)
    return [m.content for m in run(chat.abatch(INNOCENT))]


@given(kw=fields, inp=chat_input, completion=st.booleans())
def test_any_langchain_call_answers_or_fails_typed(tiny_model_dir, expected, kw, inp, completion) -> None:
    kind = MLXParallmLLM if completion else ChatMLXParallm
    try:
        model = kind(model=str(tiny_model_dir), **{"max_tokens": 8, **kw})
    except (ValidationError, MLXParallmError):
        event("refused at construction")
        return
    innocent_model = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=6)

    async def together():
        return await asyncio.gather(model.ainvoke(inp), *(innocent_model.ainvoke(q) for q in INNOCENT), return_exceptions=True)

    fuzzed, *innocent = run(together())
    event(f"{kind.__name__}: {type(fuzzed).__name__}")
    if isinstance(fuzzed, BaseException):
        assert _typed(fuzzed), "untyped error:\n" + "".join(traceback.format_exception(fuzzed))
    assert [getattr(m, "content", m) for m in innocent] == expected
