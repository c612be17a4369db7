"""render_chat with real (offline-built) tokenizers: SmolLM2's plain ChatML template and a
Qwen2.5-style template that renders tools."""

from __future__ import annotations

import json

import pytest

from fakes import QWEN_TOOLS_TEMPLATE, SMOLLM2_TEMPLATE, make_tokenizer
from mlx_parallm_provider.chat import FALLBACK_TOOL_PROMPT, content_text, normalize_messages, render_chat, template_supports_tools, tool_call_format
from mlx_parallm_provider.errors import InvalidParameterError

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
]
RENDERED_HISTORY = (
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smol() -> object:
    return make_tokenizer(SMOLLM2_TEMPLATE)


@pytest.fixture(scope="module")
def qwen() -> object:
    return make_tokenizer(QWEN_TOOLS_TEMPLATE)


# --------------------------------------------------------------------------- plain chats


def test_smollm_chat_matches_the_template_exactly(smol: object) -> None:
    text = render_chat(smol, [{"role": "user", "content": "Hi"}])
    assert text == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_system_message_replaces_the_default_one(smol: object) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(smol, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_developer_role_is_a_system_message(smol: object) -> None:
    text = render_chat(smol, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_without_generation_prompt(smol: object) -> None:
    text = render_chat(smol, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"


def test_text_parts_are_joined(smol: object) -> None:
    content = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    text = render_chat(smol, [{"role": "user", "content": content}])
    assert "<|im_start|>user\nHello, world<|im_end|>" in text


def test_the_result_tokenizes_to_single_special_tokens(smol: object) -> None:
    text = render_chat(smol, [{"role": "user", "content": "Hi"}])
    ids = smol.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    im_start = smol.convert_tokens_to_ids("<|im_start|>")  # type: ignore[attr-defined]
    assert ids.count(im_start) == 3
    assert smol.decode(ids) == text  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[1]"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], "messages[1].role"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "messages[0].content[0].text"),
        (["hello"], "messages[0]"),
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "messages[0].tool_calls[0].function.name"),
    ],
)
def test_bad_messages_name_the_field(smol: object, messages: object, field: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        render_chat(smol, messages)  # type: ignore[arg-type]
    assert info.value.field == field


def test_image_error_says_what_to_do(smol: object) -> None:
    with pytest.raises(InvalidParameterError, match="image_url.*text-only"):
        content_text([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0].content")


def test_normalize_messages_decodes_arguments_and_names_tool_results() -> None:
    out = normalize_messages(HISTORY)
    assert out[1]["content"] == ""
    assert out[1]["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert out[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1", "name": "get_weather"}


def test_normalize_messages_accepts_legacy_and_langchain_shapes() -> None:
    out = normalize_messages(
        [
            {"role": "assistant", "content": "", "function_call": {"name": "get_weather", "arguments": "{}"}},
            {"role": "function", "name": "get_weather", "content": "18C"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "args": {"city": "Oslo"}, "id": "c9"}]},
        ]
    )
    assert out[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {}}
    assert out[1] == {"role": "tool", "content": "18C", "name": "get_weather"}
    assert out[2]["tool_calls"][0] == {"id": "c9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}


# --------------------------------------------------------------------------- tools, template without tool support


def test_smollm_template_has_no_tool_support(smol: object, qwen: object) -> None:
    assert not template_supports_tools(smol)
    assert template_supports_tools(qwen)


def test_tools_go_into_the_system_message_for_a_plain_template(smol: object) -> None:
    text = render_chat(smol, [{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    system = text.split("<|im_end|>", 1)[0]
    assert system == "<|im_start|>system\n" + FALLBACK_TOOL_PROMPT.format(tools=json.dumps(WEATHER))
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_the_tool_prompt_follows_an_existing_system_message(smol: object) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_chat(smol, messages, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1


def test_tool_history_renders_as_text_for_a_plain_template(smol: object) -> None:
    text = render_chat(smol, HISTORY, [WEATHER])
    assert text.endswith(RENDERED_HISTORY)


def test_tool_history_renders_even_without_tools(smol: object) -> None:
    assert render_chat(smol, HISTORY) == SMOL_SYSTEM + RENDERED_HISTORY


def test_assistant_text_and_calls_render_together(smol: object) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]
    text = render_chat(smol, messages, add_generation_prompt=False)
    assert text.endswith('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_plain_template_output_is_what_the_hermes_parser_reads(smol: object) -> None:
    assert tool_call_format(smol).start == "<tool_call>"


# --------------------------------------------------------------------------- tools, template with tool support


def test_a_tool_template_renders_the_tools_itself(qwen: object) -> None:
    text = render_chat(qwen, [{"role": "user", "content": "Weather?"}], [WEATHER])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert "If no function call is needed" not in text  # not our fallback prompt


def test_a_tool_template_renders_history_with_object_arguments(qwen: object) -> None:
    text = render_chat(qwen, HISTORY, [WEATHER])
    assert text.endswith(RENDERED_HISTORY)  # arguments rendered as JSON objects, not strings


def test_a_tool_template_without_tools_renders_its_plain_branch(qwen: object) -> None:
    text = render_chat(qwen, [{"role": "user", "content": "Hi"}])
    assert "# Tools" not in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_an_mlx_lm_tokenizer_wrapper_renders_the_same(qwen: object) -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    wrapped = TokenizerWrapper(qwen)
    assert render_chat(wrapped, HISTORY, [WEATHER]) == render_chat(qwen, HISTORY, [WEATHER])


# --------------------------------------------------------------------------- awkward templates


GEMMA_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


def test_a_template_without_system_role_gets_the_tools_in_the_first_user_turn() -> None:
    text = render_chat(make_tokenizer(GEMMA_LIKE), [{"role": "user", "content": "Weather?"}], [WEATHER])
    assert text.startswith("<start_of_turn>user\n# Tools\n")
    assert text.endswith("\n\nWeather?<end_of_turn>\n<start_of_turn>model\n")


def test_a_conversation_the_template_rejects_is_an_invalid_parameter() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidParameterError, match="must alternate") as info:
        render_chat(make_tokenizer(ALTERNATING), messages)
    assert info.value.field == "messages"


def test_no_chat_template_gives_a_plain_transcript() -> None:
    text = render_chat(make_tokenizer(None), [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "System: Be brief.\n\nUser: Hi\n\nAssistant:"


def test_pydantic_message_objects_are_accepted(smol: object) -> None:
    from pydantic import BaseModel

    class Function(BaseModel):
        name: str
        arguments: str

    class Call(BaseModel):
        id: str
        type: str = "function"
        function: Function

    class Msg(BaseModel):
        role: str
        content: str | None = None
        tool_calls: list[Call] | None = None

    messages = [
        Msg(role="user", content="Weather in Paris and Rome?"),
        Msg(role="assistant", tool_calls=[Call(id="call_1", function=Function(name="get_weather", arguments='{"city": "Paris"}'))]),
    ]
    text = render_chat(smol, messages, add_generation_prompt=False)
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n')
