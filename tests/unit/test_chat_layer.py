"""The chat layer's two halves: prepare_chat (one request to one prompt, decided once)
and reading the output (whole or streamed) into the same content and calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from fakes import QWEN_TOOLS_TEMPLATE, TIME, WEATHER, make_tokenizer

from mlx_parallm_provider.chat import (
    HERMES_FORMAT,
    REQUIRED_TOOL_INSTRUCTION,
    ChatStreamReader,
    ContentEvent,
    FinalEvent,
    InvalidToolCallEvent,
    ToolCallEvent,
    fallback_tool_prompt,
    prepare_chat,
    read_completion,
    render_chat,
)
from mlx_parallm_provider.engine import Completion, Delta, Usage
from mlx_parallm_provider.errors import InvalidParameterError

HI = [{"role": "user", "content": "Hi"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = "Let me check.\n" + CALL + '\n<tool_call>{"name": "get_time", "arguments": {</tool_call>\n' + CALL


@pytest.mark.parametrize(
    ("messages", "kwargs", "field"),
    [
        ([{"content": "hi"}], {}, "messages[0].role"),
        ([{"role": ["user"], "content": "hi"}], {}, "messages[0].role"),
        ([*HI, {"role": "tool", "tool_call_id": "call_x", "content": "18C"}], {}, "messages[1].tool_call_id"),
        (HI, {"tools": "abc"}, "tools"),
        (HI, {"tools": {"type": "function"}}, "tools"),
        (HI, {"response_format": {"type": "yaml"}}, "response_format"),
        (HI, {"response_format": {"type": "json_object", "schema": "{}"}}, "response_format.schema"),
        (HI, {"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_malformed_requests_name_the_field(messages: Any, kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        prepare_chat(make_tokenizer(), messages, **kwargs)
    assert info.value.field == field


def test_a_tool_result_answering_an_earlier_call_is_accepted() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [*HI, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    assert "<tool_response>\n18C\n</tool_response>" in prepare_chat(make_tokenizer(), messages).prompt


def test_a_plain_template_gets_the_fallback_prompt_and_the_hermes_format() -> None:
    prepared = prepare_chat(make_tokenizer(), HI, tools=[WEATHER, TIME], tool_choice="required")
    assert fallback_tool_prompt([WEATHER, TIME]) in prepared.prompt and REQUIRED_TOOL_INSTRUCTION in prepared.prompt
    assert prepared.tool_format == HERMES_FORMAT and prepared.tools == [WEATHER, TIME]


def test_a_tool_template_renders_the_tools_itself_and_the_format_matches() -> None:
    qwen = make_tokenizer(QWEN_TOOLS_TEMPLATE)
    prepared = prepare_chat(qwen, HI, tools=[WEATHER])
    assert prepared.prompt == render_chat(qwen, HI, [WEATHER])
    assert "If no function call is needed" not in prepared.prompt
    assert prepared.tool_format.start == "<tool_call>"


def test_tool_choice_none_shows_no_tools_and_parses_none() -> None:
    prepared = prepare_chat(make_tokenizer(), HI, tools=[WEATHER], tool_choice="none")
    assert prepared.tools is None and "<tools>" not in prepared.prompt
    assert read_completion(prepared, Completion("r", CALL, [], "stop", Usage(1, 2))).content == CALL


def _stream(prepared: Any, text: str, rng: random.Random) -> list[Any]:
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    reader = ChatStreamReader(prepared)
    events: list[Any] = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events += reader.on_delta(Delta("r", piece, [], "stop" if last else None, Usage(1, 2) if last else None))
    return events


@pytest.mark.parametrize("parallel", [True, False])
def test_a_stream_reads_into_the_same_answer_as_the_whole_text(parallel: bool) -> None:
    prepared = prepare_chat(make_tokenizer(), HI, tools=[WEATHER, TIME], parallel_tool_calls=parallel)
    whole = read_completion(prepared, Completion("r", TEXT, [], "stop", Usage(1, 2)))
    assert [c.name for c in whole.tool_calls] == ["get_weather", "get_weather"][: 2 if parallel else 1]
    assert len(whole.invalid_tool_calls) == 1 and whole.finish_reason == "tool_calls"
    for seed in range(5):
        events = _stream(prepared, TEXT, random.Random(seed))
        assert "".join(e.text for e in events if isinstance(e, ContentEvent)) == whole.content
        calls = [e for e in events if isinstance(e, ToolCallEvent)]
        assert [(e.call.name, json.loads(e.call.arguments)) for e in calls] == [(c.name, c.args) for c in whole.tool_calls]
        assert [e.index for e in calls] == list(range(len(calls)))
        positions = [e.position for e in events if isinstance(e, (ToolCallEvent, InvalidToolCallEvent))]
        assert positions == list(range(len(positions)))
        assert events[-1] == FinalEvent("tool_calls", Usage(1, 2), [])
