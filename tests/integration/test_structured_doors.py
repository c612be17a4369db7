"""Issue 11 through the front doors, on the tiny random-weight model: whatever it would
say, JSON output and forced tool calls parse and validate, because decoding is constrained.
(A prompted random model would almost never produce either.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import litellm
import pytest
from pydantic import BaseModel

from mlx_parallm_provider.langchain import ChatMLXParallm

pytestmark = pytest.mark.usefixtures("fresh_litellm_engines")

N = 16
CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "unit": {"enum": ["km", "mi"]}},
        "required": ["amount", "unit"], "additionalProperties": False}}},
]
SCHEMAS = [
    {"type": "object", "properties": {"city": CITY, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                      "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                                                "required": ["lat"], "additionalProperties": False}},
     "required": ["city", "tags", "where"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["ok", "n"], "additionalProperties": False},
]


def _valid(value: Any, schema: dict) -> bool:
    """A small validator for the schema features used here."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value) and set(value) <= set(props)
                and all(_valid(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", 10**9) and all(_valid(v, schema["items"]) for v in value)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and schema.get("minimum", -10**9) <= value <= schema.get("maximum", 10**9)
    if kind == "boolean":
        return isinstance(value, bool)
    return isinstance(value, str)


def _many(model: str, **kw: Any) -> list[Any]:
    async def calls():
        return await asyncio.gather(*(litellm.acompletion(model=model, messages=[{"role": "user", "content": f"Question {i}"}],
                                                          temperature=1.0, seed=i, max_tokens=64, **kw) for i in range(N)))

    return asyncio.run(calls())


def test_litellm_required_tool_choice_always_calls_a_tool_with_valid_arguments(tiny_model_dir) -> None:
    responses = _many(f"mlx-parallm/{tiny_model_dir}", tools=TOOLS, tool_choice="required")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for r in responses:
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        for call in calls:
            assert _valid(json.loads(call.function.arguments), schemas[call.function.name])


def test_litellm_named_tool_choice_always_calls_that_tool(tiny_model_dir) -> None:
    named = {"type": "function", "function": {"name": "convert"}}
    responses = _many(f"mlx-parallm/{tiny_model_dir}", tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    for r in responses:
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "convert" and _valid(json.loads(call.function.arguments), TOOLS[2]["function"]["parameters"])


@pytest.mark.parametrize("schema", SCHEMAS)
def test_litellm_json_schema_output_always_validates(tiny_model_dir, schema) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for r in _many(f"mlx-parallm/{tiny_model_dir}", response_format=fmt):
        assert r.choices[0].finish_reason == "stop" and _valid(json.loads(r.choices[0].message.content), schema)


def test_litellm_invalid_schema_is_a_bad_request(tiny_model_dir) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    with pytest.raises(litellm.BadRequestError, match="json_schema"):
        litellm.completion(model=f"mlx-parallm/{tiny_model_dir}", messages=[{"role": "user", "content": "hi"}], response_format=fmt)


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_schema_failing_on_the_tokenizer_is_a_bad_request(tiny_model_dir, stream) -> None:
    """Issue 21 item 8: a required $ref that never ends compiles, then failed at its first
    token as a 500 with llguidance's text; now a 400 at submit naming the cause."""
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$defs": {"node": node}, "$ref": "#/$defs/node"}}}
    with pytest.raises(litellm.BadRequestError, match="recurse") as caught:
        response = litellm.completion(model=f"mlx-parallm/{tiny_model_dir}", messages=[{"role": "user", "content": "hi"}],
                                      response_format=fmt, stream=stream, max_tokens=16)
        list(response) if stream else None
    assert "<non-verbose/>" not in str(caught.value)


class Reading(BaseModel):
    """A reading."""

    ok: bool
    n: int


def test_langchain_structured_output_and_forced_tools_always_parse(tiny_model_dir) -> None:
    chat = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=64, temperature=1.0)
    structured = chat.with_structured_output(Reading, method="json_schema")
    readings = asyncio.run(structured.abatch([f"Reading {i}" for i in range(8)], config={"max_concurrency": 8}))
    assert all(isinstance(r, Reading) for r in readings)
    forced = chat.bind_tools(TOOLS, tool_choice="any")
    messages = asyncio.run(forced.abatch([f"Task {i}" for i in range(8)]))
    assert all(m.tool_calls and m.tool_calls[0]["name"] in {"get_weather", "get_time", "convert"} for m in messages)
