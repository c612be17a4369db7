"""Tool definitions, tool_choice, the fallback prompt and tool-call parsing (batch and streamed)."""

from __future__ import annotations

import json
import random
import re

import pytest

from fakes import QWEN_TOOLS_TEMPLATE, TIME, WEATHER, make_tokenizer
from mlx_parallm_provider.chat import (
    HERMES_FORMAT,
    NAMED_TOOL_INSTRUCTION,
    REQUIRED_TOOL_INSTRUCTION,
    InvalidToolCall,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    ToolCallStreamParser,
    add_system_instruction,
    apply_tool_choice,
    fallback_tool_prompt,
    normalize_tools,
    parse_tool_calls,
    render_tool_call_text,
    template_supports_tools,
    tool_call_format,
)
from mlx_parallm_provider.errors import InvalidParameterError

TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# --------------------------------------------------------------------------- definitions


def test_normalize_tools_accepts_openai_and_bare_function_dicts() -> None:
    bare = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
    assert normalize_tools([WEATHER, bare]) == [WEATHER, TIME]
    assert normalize_tools(None) is None and normalize_tools([]) is None


def test_normalize_tools_fills_in_missing_parameters() -> None:
    [tool] = normalize_tools([{"type": "function", "function": {"name": "ping"}}])
    assert tool["function"]["parameters"] == {"type": "object", "properties": {}}


def test_normalize_tools_accepts_langchain_converted_tools() -> None:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city name.
        """
        return "sunny"

    [tool] = normalize_tools([convert_to_openai_tool(get_weather)])
    assert tool["type"] == "function"
    assert tool["function"]["name"] == "get_weather"
    assert tool["function"]["parameters"]["properties"]["city"]["type"] == "string"


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([WEATHER, {"type": "function", "function": {"name": "x", "parameters": "nope"}}], "tools[1].function.parameters"),
        ([WEATHER, WEATHER], "tools"),
        (["get_weather"], "tools[0]"),
        ({"type": "function"}, "tools"),
    ],
)
def test_normalize_tools_rejects_bad_definitions_naming_the_field(tools: object, field: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        normalize_tools(tools)  # type: ignore[arg-type]
    assert info.value.field == field


# --------------------------------------------------------------------------- tool_choice


def test_tool_choice_auto_keeps_all_tools_without_instruction() -> None:
    assert apply_tool_choice(TOOLS, None) == (TOOLS, None)
    assert apply_tool_choice(TOOLS, "auto") == (TOOLS, None)


def test_tool_choice_none_drops_the_tools() -> None:
    assert apply_tool_choice(TOOLS, "none") == (None, None)


@pytest.mark.parametrize("choice", ["required", "any", True])
def test_tool_choice_required_adds_an_instruction(choice: object) -> None:
    assert apply_tool_choice(TOOLS, choice) == (TOOLS, REQUIRED_TOOL_INSTRUCTION)


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "get_time"])
def test_named_tool_choice_keeps_only_that_tool(choice: object) -> None:
    tools, instruction = apply_tool_choice(TOOLS, choice)
    assert tools == [TIME]
    assert instruction == NAMED_TOOL_INSTRUCTION.format(name="get_time")
    assert '"get_time"' in instruction


@pytest.mark.parametrize(
    ("tools", "choice"),
    [(TOOLS, {"type": "function", "function": {"name": "nope"}}), (TOOLS, 42), (None, "required")],
)
def test_bad_tool_choice_is_an_invalid_parameter(tools: object, choice: object) -> None:
    with pytest.raises(InvalidParameterError) as info:
        apply_tool_choice(tools, choice)  # type: ignore[arg-type]
    assert info.value.field == "tool_choice"


def test_add_system_instruction_appends_to_the_system_message_or_inserts_one() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert add_system_instruction(messages, "Call a tool.")[0] == {"role": "system", "content": "Be brief.\n\nCall a tool."}
    assert messages[0]["content"] == "Be brief."  # the caller's list is not modified
    inserted = add_system_instruction([{"role": "user", "content": "hi"}], "Call a tool.")
    assert inserted == [{"role": "system", "content": "Call a tool."}, {"role": "user", "content": "hi"}]
    assert add_system_instruction(messages, None) == messages


# --------------------------------------------------------------------------- prompting


def test_fallback_prompt_lists_each_tool_as_json_and_asks_for_hermes_calls() -> None:
    prompt = fallback_tool_prompt(TOOLS)
    tools_block = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in tools_block.splitlines()] == TOOLS
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt


def test_render_tool_call_text_round_trips_through_the_parser() -> None:
    text = render_tool_call_text("get_weather", '{"city": "Paris"}')
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    [call] = parse_tool_calls(text, TOOLS).tool_calls
    assert (call.name, call.args) == ("get_weather", {"city": "Paris"})


# --------------------------------------------------------------------------- parsing


def test_plain_text_is_returned_unchanged() -> None:
    text = "  The weather is nice.\n"
    assert parse_tool_calls(text, TOOLS) == ParsedOutput(content=text)


def test_one_call_after_some_text() -> None:
    parsed = parse_tool_calls("Let me check.\n" + call_text("get_weather", {"city": "Paris"}) + "\n", TOOLS)
    assert parsed.content == "Let me check."
    [call] = parsed.tool_calls
    assert CALL_ID.match(call.id)
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}
    assert parsed.invalid_tool_calls == []


def test_several_calls_get_distinct_ids() -> None:
    text = call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_time", {})
    parsed = parse_tool_calls(text, TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert parsed.content == ""


def test_lenient_json_forms_small_models_write() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'  # args as a string
        '<tool_call>{"name": "get_time", "parameters": {}}}</tool_call>'  # "parameters", extra brace
        '<tool_call>```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```</tool_call>'  # code fence
        '<tool_call>{"name": "get_time"}\n{"name": "get_time", "arguments": {}}</tool_call>'  # two objects, no args
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.args) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
        ("get_time", {}),
    ]
    assert parsed.invalid_tool_calls == []


def test_malformed_json_is_an_invalid_call_and_the_text_around_it_is_kept() -> None:
    raw = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    parsed = parse_tool_calls("Checking. " + raw + " Done.", TOOLS)
    assert parsed.tool_calls == []
    [bad] = parsed.invalid_tool_calls
    assert bad.raw == raw
    assert "not valid JSON" in bad.error
    assert CALL_ID.match(bad.id)
    assert parsed.content == "Checking.\nDone."


@pytest.mark.parametrize(
    ("body", "error", "name"),
    [
        ('{"name": "launch_rockets", "arguments": {}}', "unknown function 'launch_rockets'", "launch_rockets"),
        ('{"arguments": {"city": "Paris"}}', "no function 'name'", None),
        ('{"name": "get_weather", "arguments": [1, 2]}', "must be a JSON object", "get_weather"),
        ('{"name": "get_weather", "arguments": "{city: Paris}"}', "not valid JSON", "get_weather"),
        ('"just a string"', "must be a JSON object", None),
        ("", "not valid JSON", None),
    ],
)
def test_wrong_calls_are_invalid_with_a_reason(body: str, error: str, name: object) -> None:
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
    assert parsed.tool_calls == []
    [bad] = parsed.invalid_tool_calls
    assert error in bad.error
    assert bad.name == name


def test_without_tools_any_function_name_is_accepted() -> None:
    [call] = parse_tool_calls(call_text("anything", {"x": 1})).tool_calls
    assert call.name == "anything"


def test_an_unterminated_call_is_still_parsed() -> None:
    parsed = parse_tool_calls('Sure <tool_call>\n{"name": "get_time", "arguments": {}}\n', TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_time"]
    assert parsed.content == "Sure"


@pytest.mark.parametrize("tail", ["\n<", "\n</", "\n</tool_", "</tool_call"])
def test_a_call_cut_inside_its_end_marker_is_parsed(tail: str) -> None:
    # The token budget ran out while the grammar was writing the end marker after a closed
    # call: the call is whole (it was an invalid call, where a budget 2 tokens shorter, ending
    # at the JSON's last brace, gave a valid one).
    text = 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": ""}}' + tail
    parsed = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": ""}')]
    assert parsed.invalid_tool_calls == [] and parsed.content == "Sure"
    stream = ToolCallStreamParser(TOOLS)
    events = [e for piece in re.findall(".{1,3}", text, re.S) for e in stream.feed(piece)] + stream.finish()
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["get_weather"]
    assert "".join(e for e in events if isinstance(e, str)) == "Sure"


def test_a_cut_off_call_is_invalid_and_says_so() -> None:
    parsed = parse_tool_calls('<tool_call>\n{"name": "get_weather", "argu', TOOLS)
    [bad] = parsed.invalid_tool_calls
    assert "cut off" in bad.error
    assert bad.raw == '<tool_call>\n{"name": "get_weather", "argu'


@pytest.mark.parametrize("tail", ["<", "<tool", "\n<tool_call", " <tool_ca"])
def test_the_cut_start_of_one_more_call_is_not_content(tail: str) -> None:
    # The token budget ran out as the model began another call: the output ends in part of
    # the start marker, which is neither content nor a call (it was '<tool' as content).
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>' + tail
    parsed = parse_tool_calls(text, TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_time"] and parsed.content == ""
    stream = ToolCallStreamParser(TOOLS)
    events = [e for piece in re.findall(".{1,3}", text, re.S) for e in stream.feed(piece)] + stream.finish()
    assert [e for e in events if isinstance(e, str)] == [] and len([e for e in events if isinstance(e, ToolCall)]) == 1


def test_text_ending_like_a_marker_without_a_call_stays_content() -> None:
    assert parse_tool_calls("Compare a <tool", TOOLS).content == "Compare a <tool"
    assert parse_tool_calls("x <", TOOLS).content == "x <"


def test_a_bare_json_call_counts_when_it_names_a_tool() -> None:
    parsed = parse_tool_calls('```json\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n```', TOOLS)
    assert [(c.name, c.args) for c in parsed.tool_calls] == [("get_weather", {"city": "Lima"})]
    assert parsed.content == ""


@pytest.mark.parametrize(
    "text",
    ['{"answer": 42}', '{"name": "launch_rockets", "arguments": {}}', '[1, 2, 3]', "{not json"],
)
def test_json_that_is_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, TOOLS) == ParsedOutput(content=text)


def test_bare_json_is_content_without_tools_or_when_disabled() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    assert parse_tool_calls(text).tool_calls == []
    assert parse_tool_calls(text, TOOLS, allow_bare_json=False).content == text


def test_parse_never_raises_on_garbage() -> None:
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"get_time"', '"arguments"', "[", "]", "x", " ", "\n", "```"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
        parsed = parse_tool_calls(text, TOOLS)
        assert isinstance(parsed, ParsedOutput)
        assert all(isinstance(c, ToolCall) for c in parsed.tool_calls)
        assert all(isinstance(c, InvalidToolCall) for c in parsed.invalid_tool_calls)


# --------------------------------------------------------------------------- other formats


class _TokenizerWithParser:
    """What an mlx-lm TokenizerWrapper exposes for a model with its own tool format."""

    chat_template = "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"

    def __init__(self, parser_type: str) -> None:
        import importlib

        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_type}")
        self.tool_parser = module.parse_tool_call
        self.tool_call_start = module.tool_call_start
        self.tool_call_end = module.tool_call_end


def test_a_native_format_uses_mlx_lm_s_parser() -> None:
    fmt = tool_call_format(_TokenizerWithParser("qwen3_coder"))
    assert (fmt.name, fmt.start, fmt.end) == ("qwen3_coder", "<tool_call>", "</tool_call>")
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    [call] = parse_tool_calls(text, TOOLS, fmt).tool_calls
    assert (call.name, call.args) == ("get_weather", {"city": "Paris"})


def test_a_format_without_end_marker_runs_to_the_end() -> None:
    fmt = tool_call_format(_TokenizerWithParser("mistral"))
    assert fmt.end == ""
    parsed = parse_tool_calls('Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', TOOLS, fmt)
    assert parsed.content == "Sure."
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_json_tools_and_plain_templates_use_the_lenient_hermes_format() -> None:
    assert tool_call_format(_TokenizerWithParser("json_tools")) is HERMES_FORMAT

    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert not template_supports_tools(Plain())
    assert tool_call_format(Plain()) is HERMES_FORMAT


def test_a_parser_that_raises_gives_an_invalid_call() -> None:
    def explode(body: str, tools: object = None) -> object:
        raise RuntimeError("boom")

    fmt = ToolCallFormat("exploding", "<call>", "</call>", explode)
    parsed = parse_tool_calls("a <call>x</call> b", TOOLS, fmt)
    assert [c.error for c in parsed.invalid_tool_calls] == ["could not parse the tool call: boom"]
    assert parsed.content == "a\nb"


# --------------------------------------------------------------------------- streaming


def _stream(text: str, sizes: list[int], tools: object = TOOLS) -> list[object]:
    parser = ToolCallStreamParser(tools)  # type: ignore[arg-type]
    events: list[object] = []
    pos = 0
    for size in sizes:
        events += parser.feed(text[pos : pos + size])
        pos += size
    events += parser.feed(text[pos:])
    return events + parser.finish()


STREAM_CASES = [
    "Plain answer, no tools needed.  ",
    "Let me check.\n" + call_text("get_weather", {"city": "Paris"}) + "\n",
    call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_time", {}) + "\nDone.",
    "a < b and c <tool_x> d",
    "Oops <tool_call>{broken</tool_call> after",
    'Cut <tool_call>{"name": "get_time", "arguments": {}}',
    '{"name": "get_weather", "arguments": {"city": "Lima"}}',
    '{"answer": 42}',
    '[1] First item\n[2] Second <tool_call>{"name": "get_time"}</tool_call>',
    "```python\nprint(1)\n```",
    '{"name": "get_time", "arguments": {}}} trailing',
]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streaming_matches_batch_parsing_for_any_chunking(text: str) -> None:
    expected = parse_tool_calls(text, TOOLS)
    rng = random.Random(len(text))
    for sizes in ([1] * len(text), [len(text)], [rng.randint(1, 7) for _ in range(len(text))]):
        events = _stream(text, sizes)
        assert "".join(e for e in events if isinstance(e, str)) == expected.content
        calls = [(c.name, c.arguments) for c in events if isinstance(c, ToolCall)]
        assert calls == [(c.name, c.arguments) for c in expected.tool_calls]
        invalid = [c.raw for c in events if isinstance(c, InvalidToolCall)]
        assert invalid == [c.raw for c in expected.invalid_tool_calls]


def test_streaming_emits_content_before_the_call_and_the_call_once_closed() -> None:
    parser = ToolCallStreamParser(TOOLS)
    assert parser.feed("Let me check. ") == ["Let me check."]
    assert parser.feed("<tool_") == []  # might be a marker: held back
    assert parser.feed('call>{"name": "get_time", ') == []  # inside a call: held back
    [call] = parser.feed('"arguments": {}}</tool_call>')
    assert isinstance(call, ToolCall) and call.name == "get_time"
    assert parser.feed(" Anything else?") == ["\nAnything else?"]
    assert parser.finish() == []


def test_streaming_releases_a_false_marker_start() -> None:
    parser = ToolCallStreamParser(TOOLS)
    assert parser.feed("x <tool") == ["x"]
    assert parser.feed("box") == [" <toolbox"]


def test_streaming_without_tools_does_not_hold_json() -> None:
    parser = ToolCallStreamParser(None)
    assert parser.feed('{"a": 1}') == ['{"a": 1}']


def test_feeding_after_finish_is_an_error() -> None:
    parser = ToolCallStreamParser(TOOLS)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("more")


def test_streaming_holds_a_possible_bare_json_call_only_while_it_looks_like_json() -> None:
    parser = ToolCallStreamParser(TOOLS)
    assert parser.feed('```json\n{"name": "get_wea') == []
    assert parser.feed('ther", "arguments": {"city": "Lima"}}\n```') == []
    [call] = parser.finish()
    assert isinstance(call, ToolCall) and call.args == {"city": "Lima"}

    markdown = ToolCallStreamParser(TOOLS)
    assert markdown.feed("[1] First") == ["[1] First"]  # not JSON: released at once
    answer = ToolCallStreamParser(TOOLS)
    assert answer.feed('{"answer": 42} is the') == ['{"answer": 42} is the']


def test_a_plain_transformers_tokenizer_gets_the_parser_mlx_lm_would_infer() -> None:
    coder_template = QWEN_TOOLS_TEMPLATE.replace("{%- if tools %}", "{%- if tools %}{{- '<tool_call>\\n<function=' }}", 1)
    assert tool_call_format(make_tokenizer(QWEN_TOOLS_TEMPLATE)) is HERMES_FORMAT  # json_tools
    assert tool_call_format(make_tokenizer(coder_template)).name == "qwen3_coder"


def test_a_wrapper_without_a_parser_falls_back_to_hermes() -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    assert tool_call_format(TokenizerWrapper(make_tokenizer(QWEN_TOOLS_TEMPLATE))) is HERMES_FORMAT
