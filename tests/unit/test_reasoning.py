"""A reasoning model's ``<think>`` block comes back apart from its answer: LiteLLM's
``reasoning_content`` (whole and streamed), LangChain's ``additional_kwargs["reasoning_content"]``;
tool calls after the thinking parse; tokenizers without the tags, and constrained answers,
are left as they were."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import litellm
import pytest
from langchain_core.messages import AIMessageChunk

from fakes import SMOLLM2_TEMPLATE, WEATHER, FakeEngine, make_tokenizer, patch_get_engine
from mlx_parallm_provider.chat.reasoning import ReasoningSplitter, reasoning_start, split_reasoning
from mlx_parallm_provider.integrations import litellm as adapter
from mlx_parallm_provider.integrations.langchain import fields as lc_fields
from mlx_parallm_provider.langchain import ChatMLXParallm

THOUGHT = "\nThe user greets me. Say hi back.\n"
ANSWER = "Hello! How can I help?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
#: DeepSeek-R1's way: the generation prompt opens the block, so the answer starts inside it.
OPENING_TEMPLATE = SMOLLM2_TEMPLATE.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}")
assert OPENING_TEMPLATE != SMOLLM2_TEMPLATE

CASES = [
    ("<think>" + THOUGHT + "</think>\n\n" + ANSWER, False, (THOUGHT, ANSWER)),
    ("  <think>cut short by max_tok", False, ("cut short by max_tok", "")),
    (ANSWER, False, (None, ANSWER)),
    ("Text first <think>not thinking</think>", False, (None, "Text first <think>not thinking</think>")),
    ("<think></think>\n\n" + ANSWER, False, ("", ANSWER)),
    ("<thi", False, (None, "<thi")),
    ("Hmm.\n</think>\n\nFour.", True, ("Hmm.\n", "Four.")),
    ("never closed", True, ("never closed", "")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text,inside,expected", CASES)
def test_thinking_splits_the_same_whole_and_in_any_pieces(text: str, inside: bool, expected: tuple) -> None:
    assert split_reasoning(text, inside) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        splitter, pieces, at = ReasoningSplitter(inside), [], 0
        while at < len(text):
            step = rng.randint(1, 5)
            pieces += splitter.feed(text[at:at + step])
            at += step
        pieces += splitter.finish()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        content = "".join(t for kind, t in pieces if kind == "content")
        assert (reasoning if splitter.thought else None, content) == expected


def _thinking_tokenizer(template: str = SMOLLM2_TEMPLATE) -> Any:
    tokenizer = make_tokenizer(template)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def test_only_a_tokenizer_with_both_tags_as_tokens_splits() -> None:
    assert reasoning_start(make_tokenizer(), "<|im_start|>assistant\n") is None
    tokenizer = _thinking_tokenizer()
    assert reasoning_start(tokenizer, "<|im_start|>assistant\n") is False
    assert reasoning_start(tokenizer, "<|im_start|>assistant\n<think>\n") is True
    assert reasoning_start(tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is False  # thinking switched off


@pytest.fixture
def doors(monkeypatch: pytest.MonkeyPatch) -> Any:
    saved = list(litellm.custom_provider_map)
    adapter.register()

    def use(answer: str, tokenizer: Any) -> FakeEngine:
        fake = FakeEngine(answer, default=answer, tokenizer=tokenizer, chunk_size=4)
        patch_get_engine(monkeypatch, fake)
        monkeypatch.setattr(lc_fields, "get_engine", lambda model: fake)
        return fake

    yield use
    litellm.custom_provider_map[:] = saved


HI = [{"role": "user", "content": "Hi"}]


def _litellm_stream(**kw: Any) -> tuple[str, str, list[Any]]:
    chunks = list(litellm.completion(model="mlx-parallm/fake", messages=HI, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return "".join(getattr(d, "reasoning_content", None) or "" for d in deltas), "".join(d.content or "" for d in deltas), chunks


@pytest.mark.parametrize("template,answer", [
    (SMOLLM2_TEMPLATE, "<think>" + THOUGHT + "</think>\n\n" + ANSWER),
    (OPENING_TEMPLATE, THOUGHT + "</think>\n\n" + ANSWER),
])
def test_litellm_and_langchain_give_the_thinking_apart(doors: Any, template: str, answer: str) -> None:
    engine = doors(answer, _thinking_tokenizer(template))
    whole = litellm.completion(model="mlx-parallm/fake", messages=HI).choices[0].message
    assert (whole.reasoning_content, whole.content) == (THOUGHT, ANSWER)
    reasoning, content, chunks = _litellm_stream()
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert len({c.id for c in chunks}) == 1 and {c.model for c in chunks} == {"fake"}  # one stream, whatever the chunk type
    assert chunks[0].choices[0].delta.role == "assistant"

    async def astream() -> tuple[str, str]:
        pieces = [c.choices[0].delta async for c in await litellm.acompletion(model="mlx-parallm/fake", messages=HI, stream=True) if c.choices]
        return "".join(getattr(d, "reasoning_content", None) or "" for d in pieces), "".join(d.content or "" for d in pieces)

    assert asyncio.run(astream()) == (THOUGHT, ANSWER)
    built = litellm.stream_chunk_builder(chunks).choices[0].message
    assert (built.reasoning_content, built.content) == (THOUGHT, ANSWER)
    chat = ChatMLXParallm(model="fake")
    message = chat.invoke("Hi")
    assert (message.additional_kwargs["reasoning_content"], message.content) == (THOUGHT, ANSWER)
    merged = sum(chat.stream("Hi"), AIMessageChunk(content=""))
    assert (merged.additional_kwargs["reasoning_content"], merged.content) == (THOUGHT, ANSWER)
    assert engine.last.prompt.endswith("assistant\n<think>\n" if template == OPENING_TEMPLATE else "assistant\n")


def test_a_tool_call_after_the_thinking_is_parsed(doors: Any) -> None:
    doors("<think>I need the weather tool.</think>\n\n" + CALL, _thinking_tokenizer())
    whole = litellm.completion(model="mlx-parallm/fake", messages=HI, tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "I need the weather tool."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    reasoning, content, chunks = _litellm_stream(tools=[WEATHER])
    assert reasoning == "I need the weather tool." and content == ""
    assert litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls[0].function.name == "get_weather"
    message = ChatMLXParallm(model="fake").bind_tools([WEATHER]).invoke("Hi")
    assert message.tool_calls[0]["args"] == {"city": "Paris"} and message.additional_kwargs["reasoning_content"]


def test_without_tags_or_under_a_grammar_the_text_is_the_answer(doors: Any) -> None:
    text = "<think>" + THOUGHT + "</think>\n\n" + ANSWER
    doors(text, make_tokenizer())  # the tags are plain text to this tokenizer
    whole = litellm.completion(model="mlx-parallm/fake", messages=HI).choices[0].message
    assert whole.content == text and getattr(whole, "reasoning_content", None) is None  # (LiteLLM drops an unset field)
    assert "reasoning_content" not in ChatMLXParallm(model="fake").invoke("Hi").additional_kwargs
    doors('{"a": 1}', _thinking_tokenizer())
    constrained = litellm.completion(model="mlx-parallm/fake", messages=HI, response_format={"type": "json_object"}).choices[0].message
    assert constrained.content == '{"a": 1}' and getattr(constrained, "reasoning_content", None) is None


def test_the_messages_and_responses_bridges_carry_the_thinking(doors: Any) -> None:
    """LiteLLM's Anthropic Messages and OpenAI Responses bridges (what the proxy serves on
    /v1/messages and /v1/responses) turn it into a thinking block and a reasoning item."""
    doors("<think>" + THOUGHT + "</think>\n\n" + ANSWER, _thinking_tokenizer())

    async def calls() -> tuple[Any, list[Any], Any]:
        whole = await litellm.anthropic.messages.acreate(model="mlx-parallm/fake", messages=HI, max_tokens=200)
        stream = await litellm.anthropic.messages.acreate(model="mlx-parallm/fake", messages=HI, max_tokens=200, stream=True)
        events = [e async for e in stream]
        responses = await litellm.aresponses(model="mlx-parallm/fake", input="Hi", max_output_tokens=200)
        return whole, events, responses

    whole, events, responses = asyncio.run(calls())
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in whole["content"]] == [("thinking", THOUGHT), ("text", ANSWER)]
    text = b"".join(e if isinstance(e, bytes) else str(e).encode() for e in events).decode()
    deltas = [json.loads(line[6:])["delta"] for line in text.splitlines() if line.startswith("data: ") and "content_block_delta" in line]
    assert "".join(d.get("thinking", "") for d in deltas) == THOUGHT and "".join(d.get("text", "") for d in deltas) == ANSWER
    assert [o.type for o in responses.output] == ["reasoning", "message"] and responses.output_text == ANSWER


def test_litellm_merge_reasoning_content_in_choices_keeps_the_text_as_generated(doors: Any) -> None:
    text = "<think>" + THOUGHT + "</think>\n\n" + ANSWER
    doors(text, _thinking_tokenizer())
    whole = litellm.completion(model="mlx-parallm/fake", messages=HI, merge_reasoning_content_in_choices=True).choices[0].message
    assert whole.content == text and getattr(whole, "reasoning_content", None) is None
    assert _litellm_stream(merge_reasoning_content_in_choices=True)[:2] == ("", text)


def test_reasoning_tokens_count_the_thinking_between_its_tags() -> None:
    from mlx_parallm_provider.chat.reasoning import reasoning_tokens

    tags = (7, 8)
    assert reasoning_tokens([7, 1, 2, 3, 8, 4, 5], False, tags) == 3
    assert reasoning_tokens([1, 2, 8, 4], True, tags) == 2  # the prompt opened the block
    assert reasoning_tokens([7, 1, 2], False, tags) == 2  # cut by max_tokens: all thinking
    assert reasoning_tokens([8, 4], True, tags) == 0


@pytest.mark.parametrize("template,answer", [
    (SMOLLM2_TEMPLATE, "<think>" + THOUGHT + "</think>\n\n" + ANSWER),
    (OPENING_TEMPLATE, THOUGHT + "</think>\n\n" + ANSWER),
])
def test_the_doors_report_reasoning_tokens(doors: Any, monkeypatch: pytest.MonkeyPatch, template: str, answer: str) -> None:
    """OpenAI's ``completion_tokens_details.reasoning_tokens`` (LiteLLM, whole and streamed, and
    the Responses bridge's ``output_tokens_details``) and LangChain's ``output_token_details``:
    the thinking's tokens, the tags not counted."""
    tokenizer = _thinking_tokenizer(template)
    engine = doors(answer, tokenizer)
    engine.by_tokens = True
    thought = len(tokenizer.encode(THOUGHT, add_special_tokens=False))
    whole = litellm.completion(model="mlx-parallm/fake", messages=HI)
    assert whole.usage.completion_tokens_details.reasoning_tokens == thought
    assert whole.usage.completion_tokens == len(tokenizer.encode(answer, add_special_tokens=False))
    _, _, chunks = _litellm_stream(stream_options={"include_usage": True})
    assert [c.usage.completion_tokens_details.reasoning_tokens for c in chunks if getattr(c, "usage", None)] == [thought]
    responses = litellm.responses(model="mlx-parallm/fake", input="Hi", max_output_tokens=200)
    assert responses.usage.output_tokens_details.reasoning_tokens == thought
    chat = ChatMLXParallm(model="fake")
    assert chat.invoke("Hi").usage_metadata["output_token_details"] == {"reasoning": thought}
    merged = sum(chat.stream("Hi"), AIMessageChunk(content=""))
    assert merged.usage_metadata["output_token_details"] == {"reasoning": thought}
    engine.script = engine.default = ANSWER if template == SMOLLM2_TEMPLATE else "</think>\n\n" + ANSWER
    assert litellm.completion(model="mlx-parallm/fake", messages=HI).usage.completion_tokens_details.reasoning_tokens == 0
