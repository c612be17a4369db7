"""Fuzz the LiteLLM door: any kwargs and messages to ``litellm.acompletion`` either answer
or raise one of LiteLLM's own exception classes (never a raw Python error wrapped as an
``APIConnectionError``), and innocent calls running beside them get their normal answer."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from hypothesis import event, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mlx_parallm_provider  # noqa: E402,F401  (registers the provider)
from fuzzing import PLAUSIBLE, junk, mostly, run  # noqa: E402

INNOCENT_MESSAGES = [[{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Name a city."}]]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

text = st.text(max_size=30)
content = text | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2) | junk
role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "bogus"])
tool_call = st.fixed_dictionaries({
    "id": st.sampled_from(["call_1", "call_2"]), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "nope"]),
                                       "arguments": st.sampled_from(['{"city": "Oslo"}', "{bad json", "[]"])}),
})
message = st.fixed_dictionaries(
    {"content": content},
    optional={"role": role, "tool_calls": st.lists(tool_call, max_size=2) | junk, "tool_call_id": st.sampled_from(["call_1", "zzz"]) | junk, "name": text},
)
plain_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text})
messages = mostly(
    st.lists(plain_message, min_size=1, max_size=3),
    st.integers(0, 2).flatmap(lambda i: [st.lists(plain_message | message, min_size=1, max_size=4), st.lists(message, max_size=4), junk][i]),
)

LITELLM_ONLY = {
    "n": st.integers(-1, 3) | junk,
    "tools": st.lists(st.just(WEATHER) | junk, max_size=2) | junk,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}, "bogus"]) | junk,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}]) | junk,
    "stream": st.booleans(),
    "user": text,
    "unknown_param": junk,
}
ENGINE_FIELDS = {k: v for k, v in PLAUSIBLE.items() if k not in ("ignore_eos",)}  # OpenAI names; ignore_eos is extra
kwargs = st.sets(st.sampled_from(sorted({**ENGINE_FIELDS, **LITELLM_ONLY})), max_size=4).flatmap(
    lambda names: st.fixed_dictionaries({n: {**ENGINE_FIELDS, **LITELLM_ONLY}[n] for n in names})
)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return f"mlx-parallm/{tiny_model_dir}"


@pytest.fixture(scope="module")
def expected(model):
    async def answers():
        return [await litellm.acompletion(model=model, messages=m, max_tokens=6) for m in INNOCENT_MESSAGES]

    return [r.choices[0].message.content for r in run(answers())]


async def _call(model: str, msgs, kw):
    kw = {"max_tokens": 8, **kw}
    response = await litellm.acompletion(model=model, messages=msgs, **kw)
    if kw.get("stream") is True:
        return [chunk async for chunk in response]
    return response


@given(msgs=messages, kw=kwargs)
def test_any_litellm_call_answers_or_raises_a_litellm_error(model, expected, msgs, kw) -> None:
    async def together():
        return await asyncio.gather(
            _call(model, msgs, kw),
            *(litellm.acompletion(model=model, messages=m, max_tokens=6) for m in INNOCENT_MESSAGES),
            return_exceptions=True,
        )

    fuzzed, *innocent = run(together())
    event(f"litellm: {type(fuzzed).__name__}")
    if isinstance(fuzzed, BaseException):
        assert isinstance(fuzzed, openai.OpenAIError), f"untyped error {type(fuzzed).__name__}: {fuzzed}"
        # LiteLLM wraps a raw exception as APIConnectionError, with its traceback in the
        # message. Raised in our handler, that is an untyped error of ours; raised by
        # LiteLLM's own input handling before our handler runs (messages=None, say), it is
        # LiteLLM's behaviour, which we cannot change.
        if isinstance(fuzzed, litellm.APIConnectionError):
            assert "mlx_parallm_provider" not in str(fuzzed), f"untyped error from our handler: {fuzzed}"
            event("LiteLLM's own APIConnectionError, before our handler")
    innocent_text = [getattr(r, "choices", [None])[0].message.content if not isinstance(r, BaseException) else r for r in innocent]
    assert innocent_text == expected
