"""vLLM's structured-output fields (``structured_outputs`` and the older ``guided_*``), through
LiteLLM (chat and text completion) and LangChain, on the tiny random-weight model: whatever it
would say, the output is one of the choices, matches the regex or grammar, validates against
the schema. Bad or conflicting fields are a 400 naming the field; a batch keeps its other rows."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import litellm
import pytest
from langchain_core.messages import HumanMessage, ToolMessage

from mlx_parallm_provider.errors import InvalidParameterError
from mlx_parallm_provider.langchain import ChatMLXParallm, MLXParallmLLM

pytestmark = pytest.mark.usefixtures("fresh_litellm_engines")

N = 12
CHOICES = ["yes", "no", "maybe later", "Ünïcode \"quoted\""]
REGEX = r"[0-9]{3}-[a-z]{2}"
GBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c]'
GBNF_MATCH = r"\([a-c](,[a-c]){0,3}\)"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"]}  # (open: objects are closed, so no other key appears)


def _chat_many(model: str, **kw: Any) -> list[Any]:
    async def calls():
        return await asyncio.gather(*(litellm.acompletion(model=model, messages=[{"role": "user", "content": f"Question {i}"}],
                                                          temperature=1.0, seed=i, max_tokens=48, **kw) for i in range(N)))

    return [r.choices[0] for r in asyncio.run(calls())]


def _check(kind: str, text: str) -> None:
    if kind == "choice":
        assert text in CHOICES, text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "grammar":
        assert re.fullmatch(GBNF_MATCH, text), text
    elif kind == "json":
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9, value
    else:
        assert isinstance(json.loads(text), dict), text


SPECS = {"choice": CHOICES, "regex": REGEX, "grammar": GBNF, "json": SCHEMA, "json_object": True}


@pytest.mark.parametrize("kind", list(SPECS))
def test_litellm_structured_outputs_in_extra_body_always_hold(tiny_model_dir, kind: str) -> None:
    choices = _chat_many(f"mlx-parallm/{tiny_model_dir}", extra_body={"structured_outputs": {kind: SPECS[kind]}})
    for choice in choices:
        assert choice.finish_reason == "stop"
        _check(kind, choice.message.content)
    if kind in ("choice", "regex"):  # sampled at temperature 1: not one fixed answer
        assert len({c.message.content for c in choices}) > 1


@pytest.mark.parametrize("key", ["guided_choice", "guided_regex", "guided_grammar", "guided_json"])
def test_litellm_guided_fields_of_older_vllm_hold_as_arguments(tiny_model_dir, key: str) -> None:
    kind = key.removeprefix("guided_")
    choices = _chat_many(f"mlx-parallm/{tiny_model_dir}", guided_decoding_backend="xgrammar", **{key: SPECS[kind]})
    for choice in choices:
        _check(kind, choice.message.content)


def test_litellm_text_completion_takes_structured_outputs_for_every_prompt(tiny_model_dir) -> None:
    response = litellm.text_completion(model=f"mlx-parallm/{tiny_model_dir}", prompt=[f"Story {i}:" for i in range(6)],
                                       max_tokens=24, temperature=1.0, seed=3, extra_body={"structured_outputs": {"regex": REGEX}})
    assert len(response.choices) == 6
    for choice in response.choices:
        _check("regex", choice.text)


def test_litellm_streamed_choice_holds(tiny_model_dir) -> None:
    chunks = litellm.completion(model=f"mlx-parallm/{tiny_model_dir}", messages=[{"role": "user", "content": "Pick"}], stream=True,
                                max_tokens=16, temperature=1.0, seed=5, extra_body={"structured_outputs": {"choice": CHOICES}})
    _check("choice", "".join(c.choices[0].delta.content or "" for c in chunks))


BAD = [
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 3]}}, r"structured_outputs.choice\[1\]"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": ["regex"]}, "must be a dict"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "not both"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "cannot be combined"),
]


@pytest.mark.parametrize("body,match", BAD)
def test_litellm_bad_structured_outputs_are_a_bad_request(tiny_model_dir, body: dict, match: str) -> None:
    with pytest.raises(litellm.BadRequestError, match=match):
        litellm.completion(model=f"mlx-parallm/{tiny_model_dir}", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=body)


def test_litellm_structured_outputs_cannot_follow_a_continued_message(tiny_model_dir) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is", "prefix": True}]
    with pytest.raises(litellm.BadRequestError, match="continue_final_message"):
        litellm.completion(model=f"mlx-parallm/{tiny_model_dir}", messages=messages, max_tokens=4,
                           extra_body={"structured_outputs": {"choice": CHOICES}})


def test_litellm_unsupported_whitespace_pattern_is_refused_by_name(tiny_model_dir) -> None:
    with pytest.raises(litellm.BadRequestError, match="guided_whitespace_pattern"):
        litellm.completion(model=f"mlx-parallm/{tiny_model_dir}", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                           guided_json=SCHEMA, guided_whitespace_pattern=r"\s*")


def test_langchain_chat_and_llm_take_structured_outputs(tiny_model_dir) -> None:
    chat = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=32, temperature=1.0)
    picked = chat.bind(structured_outputs={"choice": CHOICES})
    messages = asyncio.run(picked.abatch([f"Pick {i}" for i in range(8)], config={"max_concurrency": 8}))
    for message in messages:
        _check("choice", message.content)
    chunks = list(chat.stream("Code?", structured_outputs={"regex": REGEX}, seed=1))
    _check("regex", "".join(c.content for c in chunks))
    llm = MLXParallmLLM(model=str(tiny_model_dir), max_tokens=32, temperature=1.0)
    for text in llm.bind(structured_outputs={"grammar": GBNF}).batch([f"List {i}:" for i in range(6)]):
        _check("grammar", text)


def test_langchain_bad_structured_outputs_fail_alone_in_a_batch(tiny_model_dir) -> None:
    chat = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=8)
    orphan = [HumanMessage("hi"), ToolMessage("18C", tool_call_id="call_nobody")]
    outputs = chat.bind(structured_outputs={"choice": CHOICES}).batch(["Pick one.", orphan, "And another."], return_exceptions=True)
    assert isinstance(outputs[1], InvalidParameterError)
    assert all(o.content in CHOICES for o in (outputs[0], outputs[2]))
    with pytest.raises(InvalidParameterError, match="structured_outputs.regex"):
        chat.invoke("hi", structured_outputs={"regex": 3})
    with pytest.raises(InvalidParameterError, match="exactly one of"):
        MLXParallmLLM(model=str(tiny_model_dir), max_tokens=4).invoke("hi", structured_outputs={})
