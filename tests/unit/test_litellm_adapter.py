"""The LiteLLM provider, driven through LiteLLM's real entry points against a FakeEngine."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from typing import Any

import litellm
import pytest
from litellm.exceptions import MidStreamFallbackError

from fakes import QWEN_TOOLS_TEMPLATE, TIME, WEATHER, FakeEngine, chat_prompt, make_tokenizer, patch_get_engine
from mlx_parallm_provider.chat import FALLBACK_TOOL_PROMPT, JSON_OBJECT_INSTRUCTION, JSON_SCHEMA_INSTRUCTION, REQUIRED_TOOL_INSTRUCTION
from mlx_parallm_provider.errors import (
    ContextWindowExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    ModelLoadError,
    ModelNotFoundError,
    RequestFailedError,
    RequestTimeoutError,
    UnsupportedModelError,
)
from mlx_parallm_provider.integrations import litellm as adapter

MODEL = "mlx-parallm/fake"
HI = [{"role": "user", "content": "Hi"}]
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
SCRIPT = {
    "Weather in Paris?": "Let me check.\n" + PARIS_CALL,
    "Paris and Rome?": PARIS_CALL + "\n" + ROME_CALL,
    "Broken call": 'Hmm. <tool_call>{"name": "get_weather", "arguments": {</tool_call>',
}
ANSWER = "Hello from the fake engine."
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@pytest.fixture(autouse=True)
def _litellm_state() -> Any:
    """Register the provider; restore LiteLLM's globals afterwards."""
    saved_map, saved_drop = list(litellm.custom_provider_map), litellm.drop_params
    adapter.register()
    yield
    litellm.custom_provider_map[:] = saved_map
    litellm.drop_params = saved_drop


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    fake = FakeEngine(SCRIPT, default=ANSWER)
    fake.requested = patch_get_engine(monkeypatch, fake)  # type: ignore[attr-defined]
    return fake


def joined(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def streamed_tool_calls(chunks: list[Any]) -> list[Any]:
    return [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]


def finish_reasons(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


# --------------------------------------------------------------------------- plain completions


def test_completion_returns_the_engine_answer_with_usage(engine: FakeEngine) -> None:
    response = litellm.completion(model=MODEL, messages=HI)
    assert response.choices[0].message.content == ANSWER
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == "stop"
    assert response.model == "fake"
    assert response.id.startswith("chatcmpl-")
    prompt = engine.last.prompt
    assert prompt == chat_prompt(engine, HI)  # the chat template was applied
    assert response.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert response.usage.completion_tokens == len(ANSWER)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(ANSWER)


@pytest.mark.parametrize("how", ["prefix", "continue_final_message", "extra_body"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefix_message_is_continued_and_the_answer_is_what_follows_it(engine: FakeEngine, how: str, stream: bool) -> None:
    """LiteLLM's ``prefix: True`` (what its Router sends a fallback to continue a cut stream)
    and vLLM's ``continue_final_message``: the prompt ends with the assistant's text."""
    prefill = {"role": "assistant", "content": "```python\ndef"}
    kwargs: dict[str, Any] = {
        "prefix": {"messages": [*HI, {**prefill, "prefix": True}]},
        "continue_final_message": {"messages": [*HI, prefill], "continue_final_message": True},
        "extra_body": {"messages": [*HI, prefill], "extra_body": {"continue_final_message": True}},
    }[how]
    response = litellm.completion(model=MODEL, stream=stream, **kwargs)
    content = joined(list(response)) if stream else response.choices[0].message.content
    assert content == ANSWER
    assert engine.last.prompt == chat_prompt(engine, HI) + "```python\ndef"  # SmolLM2's template: the turn left open


def test_sync_completion_uses_generate_sync_and_the_model_name(engine: FakeEngine) -> None:
    litellm.completion(model="mlx-parallm/mlx-community/SmolLM2-135M-Instruct", messages=HI)
    assert engine.last.method == "generate_sync"
    assert engine.requested == ["mlx-community/SmolLM2-135M-Instruct"]  # type: ignore[attr-defined]


def test_acompletion_awaits_generate(engine: FakeEngine) -> None:
    response = asyncio.run(litellm.acompletion(model=MODEL, messages=HI))
    assert response.choices[0].message.content == ANSWER
    assert engine.last.method == "generate"


def test_openai_params_map_to_sampling_params(engine: FakeEngine) -> None:
    litellm.completion(
        model=MODEL,
        messages=HI,
        max_tokens=40,
        temperature=0.7,
        top_p=0.9,
        stop=["\n\n", "END"],
        seed=123,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"42": 5, "7": -100},
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        timeout=30,
    )
    p = engine.last.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (40, 0.7, 0.9, ["\n\n", "END"], 123)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.25, {42: 5.0, 7: -100.0})
    assert (p.top_k, p.min_p, p.repetition_penalty, p.timeout) == (20, 0.05, 1.1, 30.0)


def test_extra_body_params_and_max_completion_tokens(engine: FakeEngine) -> None:
    litellm.completion(
        model=MODEL, messages=HI, max_completion_tokens=12,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "include_stop_str_in_output": True},
    )
    p = engine.last.params
    assert (p.max_tokens, p.top_k, p.min_p, p.repetition_penalty, p.include_stop_str_in_output) == (12, 5, 0.1, 1.2, True)
    with pytest.raises(litellm.BadRequestError, match="include_stop_str_in_output"):
        litellm.completion(model=MODEL, messages=HI, include_stop_str_in_output="yes")


def test_defaults_are_the_engine_defaults(engine: FakeEngine) -> None:
    litellm.completion(model=MODEL, messages=HI)
    p = engine.last.params
    assert (p.max_tokens, p.temperature, p.seed, p.stop, p.logprobs) == (256, 0.0, None, [], False)


def test_max_tokens_cuts_the_answer(engine: FakeEngine) -> None:
    response = litellm.completion(model=MODEL, messages=HI, max_tokens=5)
    assert response.choices[0].message.content == ANSWER[:5]
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


@pytest.mark.parametrize(("stop", "expected"), [(" from", "Hello"), (["engine", "fake"], "Hello from the ")])
def test_stop_strings(engine: FakeEngine, stop: Any, expected: str) -> None:
    response = litellm.completion(model=MODEL, messages=HI, stop=stop)
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"


def test_n_choices_share_the_prompt_and_use_seed_plus_i(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine(lambda prompt, params: f"seed={params.seed}", delay=0.2)
    patch_get_engine(monkeypatch, fake)
    response = litellm.completion(model=MODEL, messages=HI, n=3, seed=10, temperature=0.8)
    assert [c.message.content for c in response.choices] == ["seed=10", "seed=11", "seed=12"]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({call.prompt for call in fake.calls}) == 1
    assert sorted(call.params.seed for call in fake.calls) == [10, 11, 12]
    assert fake.max_in_flight > 1  # submitted concurrently, not one after another
    prompt_tokens = len(fake.tokenizer.encode(fake.calls[0].prompt, add_special_tokens=False))
    assert response.usage.prompt_tokens == prompt_tokens  # one prompt, counted once
    assert response.usage.completion_tokens == 3 * len("seed=10")


def test_n_choices_async_are_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine(lambda prompt, params: f"seed={params.seed}")
    patch_get_engine(monkeypatch, fake)

    def run() -> list[str]:
        response = asyncio.run(litellm.acompletion(model=MODEL, messages=HI, n=2, seed=5, temperature=1.0))
        return [c.message.content for c in response.choices]

    assert run() == run() == ["seed=5", "seed=6"]
    assert {call.method for call in fake.calls} == {"generate"}


def test_n_without_seed_leaves_seeds_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine()
    patch_get_engine(monkeypatch, fake)
    response = litellm.completion(model=MODEL, messages=HI, n=2, temperature=0.9)
    assert len(response.choices) == 2
    assert [call.params.seed for call in fake.calls] == [None, None]


def test_logprobs_are_returned_in_openai_form(engine: FakeEngine) -> None:
    response = litellm.completion(model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2)
    assert (engine.last.params.logprobs, engine.last.params.top_logprobs) == (True, 2)
    content = response.choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "e", "l"]
    assert content[0].logprob == -0.5 and content[0].bytes == [72]
    assert [t.token for t in content[0].top_logprobs] == ["H", "!"]


# --------------------------------------------------------------------------- streaming


def test_streamed_chunks_join_to_the_full_text(engine: FakeEngine) -> None:
    chunks = list(litellm.completion(model=MODEL, messages=HI, stream=True))
    assert joined(chunks) == ANSWER
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert finish_reasons(chunks) == ["stop"]
    assert engine.last.method == "stream_sync"


def test_include_usage_puts_usage_on_the_last_chunk(engine: FakeEngine) -> None:
    chunks = list(litellm.completion(model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    prompt_tokens = len(engine.tokenizer.encode(engine.last.prompt, add_special_tokens=False))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt_tokens,
        len(ANSWER),
        prompt_tokens + len(ANSWER),
    )


def test_async_streaming_is_an_async_generator_over_engine_stream(engine: FakeEngine) -> None:
    assert inspect.isasyncgenfunction(adapter.MLXParallmCustomLLM.astreaming)

    async def run() -> list[Any]:
        stream = await litellm.acompletion(model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True})
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert joined(chunks) == ANSWER
    assert finish_reasons(chunks) == ["stop"]
    assert chunks[-1].usage.completion_tokens == len(ANSWER)
    assert engine.last.method == "stream"
    assert engine.closed_streams == 1


def test_streaming_respects_max_tokens(engine: FakeEngine) -> None:
    chunks = list(litellm.completion(model=MODEL, messages=HI, stream=True, max_tokens=7))
    assert joined(chunks) == ANSWER[:7]
    assert finish_reasons(chunks) == ["length"]


# --------------------------------------------------------------------------- tools


def test_tool_calls_are_parsed_with_finish_reason_tool_calls(engine: FakeEngine) -> None:
    response = litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert CALL_ID.match(call.id)
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tools_are_described_in_the_prompt_for_a_plain_template(engine: FakeEngine) -> None:
    litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert FALLBACK_TOOL_PROMPT.format(tools=json.dumps(WEATHER)) in engine.last.prompt


def test_a_tool_aware_template_renders_the_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine(SCRIPT, tokenizer=make_tokenizer(QWEN_TOOLS_TEMPLATE))
    patch_get_engine(monkeypatch, fake)
    response = litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert fake.last.prompt.startswith("<|im_start|>system\nYou are Qwen")
    assert "If no function call is needed" not in fake.last.prompt
    assert response.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_several_tool_calls_and_parallel_tool_calls_false(engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Paris and Rome?"}]
    both = litellm.completion(model=MODEL, messages=messages, tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    assert both.choices[0].message.content is None
    one = litellm.completion(model=MODEL, messages=messages, tools=[WEATHER], parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]


def test_tool_choice_none_drops_tools_and_parsing(engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    response = litellm.completion(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in engine.last.prompt
    assert response.choices[0].message.content == SCRIPT["Weather in Paris?"]
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


def test_tool_choice_required_and_named_add_an_instruction(engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    litellm.completion(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required")
    assert REQUIRED_TOOL_INSTRUCTION in engine.last.prompt
    named = {"type": "function", "function": {"name": "get_weather"}}
    litellm.completion(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named)
    assert 'call to the function "get_weather"' in engine.last.prompt
    assert '"name": "get_time"' not in engine.last.prompt


def test_malformed_tool_call_stays_visible_as_text(engine: FakeEngine) -> None:
    response = litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Broken call"}], tools=[WEATHER])
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert choice.message.content == 'Hmm.\n<tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    [invalid] = choice.message.provider_specific_fields["invalid_tool_calls"]
    assert "not valid JSON" in invalid["error"]


def test_tool_calls_stream_as_tool_call_chunks(engine: FakeEngine) -> None:
    chunks = list(
        litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Paris and Rome?"}], tools=[WEATHER], stream=True)
    )
    calls = streamed_tool_calls(chunks)
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Rome"}),
    ]
    assert all(CALL_ID.match(c.id) for c in calls)
    assert "<tool_call>" not in joined(chunks)
    assert finish_reasons(chunks) == ["tool_calls"]


def test_async_tool_call_streaming_keeps_the_content(engine: FakeEngine) -> None:
    async def run() -> list[Any]:
        stream = await litellm.acompletion(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], stream=True
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert joined(chunks) == "Let me check."
    assert [c.function.name for c in streamed_tool_calls(chunks)] == ["get_weather"]
    assert finish_reasons(chunks) == ["tool_calls"]


def test_streamed_malformed_call_comes_out_as_text(engine: FakeEngine) -> None:
    chunks = list(litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Broken call"}], tools=[WEATHER], stream=True))
    batch = litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Broken call"}], tools=[WEATHER])
    assert joined(chunks) == batch.choices[0].message.content
    assert streamed_tool_calls(chunks) == []
    assert finish_reasons(chunks) == ["stop"]


# --------------------------------------------------------------------------- unsupported parameters


@pytest.mark.parametrize("extra", [{"frobnicate": 1}, {"extra_body": {"mirostat": 2}}, {"frobnicate": 1, "extra_body": {"mirostat": 2}}])
def test_unsupported_params_are_a_bad_request(engine: FakeEngine, extra: dict) -> None:
    with pytest.raises(litellm.BadRequestError, match="drop_params") as info:
        litellm.completion(model=MODEL, messages=HI, **extra)
    names = [name for name in extra if name != "extra_body"] + list(extra.get("extra_body", {}))
    assert all(name in str(info.value) for name in names)
    assert f"Remove {'them' if len(names) > 1 else 'it'}, or" in str(info.value)
    assert engine.calls == []


def test_drop_params_on_the_call_drops_them(engine: FakeEngine) -> None:
    response = litellm.completion(
        model=MODEL, messages=HI, response_format={"type": "json_object"}, frobnicate=1, drop_params=True, max_tokens=4
    )
    assert response.choices[0].message.content == ANSWER[:4]


def test_global_drop_params_drops_them(engine: FakeEngine) -> None:
    litellm.drop_params = True
    response = litellm.completion(model=MODEL, messages=HI, response_format={"type": "json_object"})
    assert response.choices[0].message.content == ANSWER


def test_params_litellm_adds_are_ignored(engine: FakeEngine) -> None:
    response = litellm.completion(
        model=MODEL,
        messages=HI,
        stream_options=None,
        max_retries=0,
        metadata={"run": "x"},
        user="someone",
        response_format={"type": "text"},
    )
    assert response.choices[0].message.content == ANSWER


def test_streaming_several_choices_is_unsupported_unless_dropped(engine: FakeEngine) -> None:
    with pytest.raises(litellm.BadRequestError, match="n=2"):
        litellm.completion(model=MODEL, messages=HI, stream=True, n=2)
    chunks = list(litellm.completion(model=MODEL, messages=HI, stream=True, n=2, drop_params=True))
    assert joined(chunks) == ANSWER
    assert len(engine.calls) == 1


def test_streaming_with_logprobs_streams_the_same_text(engine: FakeEngine) -> None:
    chunks = list(litellm.completion(model=MODEL, messages=HI, stream=True, logprobs=True, top_logprobs=2))
    assert joined(chunks) == ANSWER and engine.last.params.logprobs and engine.last.params.top_logprobs == 2


# --------------------------------------------------------------------------- errors


ERRORS = [
    (InvalidParameterError("top_p", "must be > 0"), litellm.BadRequestError, "top_p"),
    (ContextWindowExceededError(2000, 256, 2048), litellm.ContextWindowExceededError, "lower max_tokens"),
    (ModelNotFoundError("no model 'nope'"), litellm.NotFoundError, "check the model name"),
    (EngineOverloadedError("queue full"), litellm.RateLimitError, "retry later"),
    (RequestTimeoutError("request r1 timed out after 1s; raise its timeout or lower max_tokens"), litellm.Timeout, "raise its timeout"),
    # Issue 8 #8: the engine restarts its worker by itself; the hint said to restart the process.
    (EngineDeadError("worker died"), litellm.ServiceUnavailableError, "retry the request"),
    (RequestFailedError("request r1 failed while processing its output"), litellm.InternalServerError, "failed while processing"),
    # Issue 21 item 14: was a generic APIError (500); a bad or unsupported file is no retry.
    (ModelLoadError("bad.gguf: invalid GGUF header: llama.attention.head_count = 0"), litellm.BadRequestError, "llama.attention.head_count = 0"),
    (UnsupportedModelError("x.gguf: architecture 'qwen3' is not supported"), litellm.BadRequestError, "architecture 'qwen3'"),
]


@pytest.mark.parametrize(("error", "expected", "hint"), ERRORS)
def test_engine_errors_map_to_litellm_errors(engine: FakeEngine, error: Exception, expected: type, hint: str) -> None:
    engine.error = error
    with pytest.raises(expected, match=re.escape(hint)):
        litellm.completion(model=MODEL, messages=HI)
    with pytest.raises(expected, match=re.escape(hint)):
        asyncio.run(litellm.acompletion(model=MODEL, messages=HI))


def test_a_timeout_says_once_what_to_change_and_for_embeddings_not_max_tokens() -> None:
    from mlx_parallm_provider.engine.embed.request import EmbedRequest
    from mlx_parallm_provider.engine.request import Request, SamplingParams

    chat = Request("r1", [1, 2], SamplingParams(), sink=None, arrival=10.0, deadline=10.5).timeout_error()
    embed = EmbedRequest("e1", [[1, 2]], "mean", sink=None, arrival=10.0, deadline=10.5).timeout_error()
    chat_message, embed_message = (str(adapter.to_litellm_error(e, "m")) for e in (chat, embed))
    assert chat_message.count("timeout") == 1 and chat_message.count("max_tokens") == 1, chat_message
    assert "0.5s" in embed_message and "fewer inputs" in embed_message and "max_tokens" not in embed_message, embed_message


def _stream_error(run_async: bool) -> BaseException:
    async def consume() -> None:
        async for _ in await litellm.acompletion(model=MODEL, messages=HI, stream=True):
            pass

    try:
        if run_async:
            asyncio.run(consume())
        else:
            list(litellm.completion(model=MODEL, messages=HI, stream=True))
    except Exception as error:  # noqa: BLE001
        return error
    raise AssertionError("the stream did not fail")


@pytest.mark.parametrize("run_async", [False, True])
@pytest.mark.parametrize(("error", "expected", "hint"), ERRORS)
def test_stream_errors_map_too(engine: FakeEngine, error: Exception, expected: type, hint: str, run_async: bool) -> None:
    engine.error = error
    raised = _stream_error(run_async)
    # LiteLLM's stream wrapper re-raises retriable errors (429, 5xx, timeouts) as a
    # MidStreamFallbackError for its Router, keeping ours as original_exception.
    if isinstance(raised, MidStreamFallbackError):
        raised = raised.original_exception
    assert isinstance(raised, expected)
    assert hint in str(raised)


def test_get_engine_errors_map_too(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(model: str = "default", config: Any = None) -> Any:
        raise ModelNotFoundError(f"no model {model!r}")

    monkeypatch.setattr(adapter, "get_engine", missing)
    with pytest.raises(litellm.NotFoundError, match="no model 'nope'"):
        litellm.completion(model="mlx-parallm/nope", messages=HI)


def test_invalid_values_are_bad_requests_naming_the_field(engine: FakeEngine) -> None:
    with pytest.raises(litellm.BadRequestError, match="temperature"):
        litellm.completion(model=MODEL, messages=HI, temperature=-1)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(litellm.BadRequestError, match=re.escape("messages[0].content[0]")):
        litellm.completion(model=MODEL, messages=image)
    with pytest.raises(litellm.BadRequestError, match="tool_choice"):
        litellm.completion(model=MODEL, messages=HI, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("timeout", [-1, 0, -0.5])
def test_a_timeout_that_is_not_positive_is_a_bad_request(engine: FakeEngine, timeout: float) -> None:
    with pytest.raises(litellm.BadRequestError, match="timeout"):
        litellm.completion(model=MODEL, messages=HI, timeout=timeout)
    assert engine.calls == []


@pytest.mark.parametrize("tools", ["abc", [], ["abc"]])
def test_tools_that_are_not_tool_definitions_are_a_bad_request(engine: FakeEngine, tools: Any) -> None:
    # LiteLLM hands the provider [] for each of these (it drops what is not a dict).
    with pytest.raises(litellm.BadRequestError, match="tools"):
        litellm.completion(model=MODEL, messages=HI, tools=tools)
    assert engine.calls == []


def test_a_tool_result_that_answers_no_call_is_a_bad_request(engine: FakeEngine) -> None:
    orphan = [*HI, {"role": "tool", "tool_call_id": "call_nobody", "content": "18C"}]
    with pytest.raises(litellm.BadRequestError, match=re.escape("messages[1].tool_call_id")):
        litellm.completion(model=MODEL, messages=orphan)
    assert engine.calls == []


def test_json_response_formats_are_prompted(engine: FakeEngine) -> None:
    litellm.completion(model=MODEL, messages=HI, response_format={"type": "json_object"})
    assert JSON_OBJECT_INSTRUCTION in engine.last.prompt
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    litellm.completion(model=MODEL, messages=HI, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert JSON_SCHEMA_INSTRUCTION.format(schema=json.dumps(schema)) in engine.last.prompt
    with pytest.raises(litellm.BadRequestError, match="response_format"):
        litellm.completion(model=MODEL, messages=HI, response_format={"type": "xml"})


def test_json_object_with_a_schema_is_prompted_as_json_mode_and_held_to_the_schema(engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    litellm.completion(model=MODEL, messages=HI, response_format={"type": "json_object", "schema": schema})
    assert JSON_OBJECT_INSTRUCTION in engine.last.prompt and json.dumps(schema) not in engine.last.prompt
    assert engine.last.params.constraint.kind == "json_schema"
    assert json.loads(engine.last.params.constraint.value)["required"] == ["name"]


# --------------------------------------------------------------------------- other entry points


def test_text_completion_uses_the_raw_prompt(engine: FakeEngine) -> None:
    response = litellm.text_completion(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert engine.last.prompt == "Once upon a time"
    assert response.choices[0].text == ANSWER[:5]
    assert response.usage.prompt_tokens == len("Once upon a time")


def test_text_completion_with_several_prompts_and_n(engine: FakeEngine) -> None:
    response = litellm.text_completion(model=MODEL, prompt=["One", "Two"], n=2, seed=1, temperature=0.5)
    assert [(c.prompt, c.params.seed) for c in sorted(engine.calls, key=lambda c: c.request_id)] == [
        ("One", 1),
        ("One", 2),
        ("Two", 1),
        ("Two", 2),
    ]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == len("One") + len("Two")


def test_text_completion_logprobs_are_refused_saying_why_unless_dropped(engine: FakeEngine) -> None:
    """LiteLLM's text_completion answers with logprobs=None for a provider behind chat
    completions, whatever it computed: a clear refusal instead of a silent None."""
    with pytest.raises(litellm.BadRequestError, match=r"logprobs=2 \(LiteLLM's text_completion returns no logprobs") as info:
        litellm.text_completion(model=MODEL, prompt="Once", max_tokens=3, logprobs=2)
    assert "drop_params" in str(info.value) and not engine.calls
    response = litellm.text_completion(model=MODEL, prompt="Once", max_tokens=3, logprobs=2, drop_params=True)
    assert response.choices[0].text == ANSWER[:3] and engine.last.params.logprobs is False


def test_atext_completion(engine: FakeEngine) -> None:
    response = asyncio.run(litellm.atext_completion(model=MODEL, prompt="Once", max_tokens=3))
    assert response.choices[0].text == ANSWER[:3]
    assert (engine.last.method, engine.last.prompt) == ("generate", "Once")


def test_batch_completion_calls_land_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine({"number 3": "three"}, default="other", delay=0.5)
    patch_get_engine(monkeypatch, fake)
    batch = [[{"role": "user", "content": f"number {i}"}] for i in range(6)]
    results = litellm.batch_completion(model=MODEL, messages=batch)
    assert [r.choices[0].message.content for r in results] == ["other", "other", "other", "three", "other", "other"]
    assert {c.method for c in fake.calls} == {"generate_sync"}
    assert len({c.thread for c in fake.calls}) == 6
    assert fake.max_in_flight >= 3


def test_concurrent_acompletions_are_in_flight_together(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeEngine(delay=0.3)
    patch_get_engine(monkeypatch, fake)

    async def run() -> list[Any]:
        return await asyncio.gather(*(litellm.acompletion(model=MODEL, messages=HI) for _ in range(6)))

    assert len(asyncio.run(run())) == 6
    assert fake.max_in_flight >= 3


# --------------------------------------------------------------------------- registration and cost


def test_completion_cost_is_zero(engine: FakeEngine) -> None:
    response = litellm.completion(model=MODEL, messages=HI)
    assert response.usage.total_tokens > 0
    assert litellm.completion_cost(completion_response=response) == 0.0
    assert response._hidden_params["response_cost"] == 0.0
    assert litellm.get_model_info(MODEL)["max_input_tokens"] == engine.context_length


def test_completion_cost_is_zero_for_a_repo_style_name(engine: FakeEngine) -> None:
    response = litellm.completion(model="mlx-parallm/org/some-model", messages=HI)
    assert litellm.completion_cost(completion_response=response) == 0.0


def test_register_is_idempotent_and_keeps_other_providers() -> None:
    other = {"provider": "someone-else", "custom_handler": litellm.CustomLLM()}
    litellm.custom_provider_map[:] = [other]
    adapter.register()
    adapter.register()
    assert litellm.custom_provider_map == [other, {"provider": "mlx-parallm", "custom_handler": adapter.litellm_handler}]
    assert "mlx-parallm" in litellm.provider_list


def test_register_repoints_a_stale_entry_instead_of_adding_one() -> None:
    other = {"provider": "someone-else", "custom_handler": litellm.CustomLLM()}
    stale = {"provider": "mlx-parallm", "custom_handler": adapter.MLXParallmCustomLLM()}
    litellm.custom_provider_map[:] = [stale, other]
    adapter.register()
    assert litellm.custom_provider_map == [{"provider": "mlx-parallm", "custom_handler": adapter.litellm_handler}, other]


def test_a_tool_round_trip_renders_the_history(engine: FakeEngine) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = litellm.completion(model=MODEL, messages=messages, tools=[WEATHER])
    message = first.choices[0].message
    messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18C"}]
    litellm.completion(model=MODEL, messages=messages, tools=[WEATHER])
    assert engine.last.prompt.endswith(
        "<|im_start|>assistant\nLet me check.\n" + PARIS_CALL + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_n_beyond_openais_limit_is_a_bad_request(engine: FakeEngine) -> None:
    # Issue 8: n=5000 through the proxy filled the queue; now any n runs in waves, so a huge n
    # would hold rows for minutes. OpenAI's own limit (128) is the bound.
    with pytest.raises(litellm.BadRequestError, match=r"n: must be <= 128"):
        litellm.completion(model=MODEL, messages=HI, n=129)


# --------------------------------------------------------------------------- issue 21 items 10 and 12


def _nested(depth: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value


@pytest.mark.parametrize("depth", [300, 1_200])
def test_deep_nesting_is_a_bad_request_naming_field_and_limit(engine: FakeEngine, depth: int) -> None:
    # Was a RecursionError, surfacing from LiteLLM as an APIConnectionError (500).
    deep_call = [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": ' * depth + "1" + "}" * depth}}]}]
    cases = [
        ({"messages": deep_call}, "messages[1].tool_calls[0].function.arguments"),
        ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(depth)}}]}, "tools[0].function.parameters"),
        ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(depth)}}}, "response_format.json_schema"),
    ]
    for kwargs, field in cases:
        with pytest.raises(litellm.BadRequestError, match=re.escape(field)) as info:
            litellm.completion(model=MODEL, **kwargs)
        assert "more than 128 levels deep" in str(info.value)
        with pytest.raises(litellm.BadRequestError, match=re.escape(field)):
            asyncio.run(litellm.acompletion(model=MODEL, **kwargs))
        with pytest.raises(litellm.BadRequestError, match=re.escape(field)):
            list(litellm.completion(model=MODEL, stream=True, **kwargs))
    assert engine.calls == []


def test_a_lone_surrogate_is_a_bad_request_naming_the_field(engine: FakeEngine) -> None:
    # Was a TypeError from tokenizers, surfacing as an APIConnectionError (500).
    messages = [*HI, {"role": "user", "content": "a\ud800b"}]
    with pytest.raises(litellm.BadRequestError, match=re.escape("messages[1].content: holds a lone surrogate (U+D800)")):
        litellm.completion(model=MODEL, messages=messages)
    with pytest.raises(litellm.BadRequestError, match=re.escape("messages[1].content")):
        list(litellm.completion(model=MODEL, messages=messages, stream=True))
    assert engine.calls == []
