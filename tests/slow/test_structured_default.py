"""Issue 11 on the real default model (SmolLM2-135M), which almost never emits a parsable
tool call or schema-valid JSON when only prompted: 16 concurrent calls each, all valid."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import litellm
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_litellm_engines")]

MODEL = "mlx-parallm/default"
N = 16
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string", "enum": ["USD", "EUR", "JPY"]}},
        "required": ["amount", "to"]}}},
]
QUESTIONS = [f"I am planning trip number {i} to {city}. What should I check first?"
             for i, city in enumerate(["Paris", "Oslo", "Lima", "Tokyo"] * 4)]


def _all(max_tokens: int = 80, **kw: Any) -> list[Any]:
    async def calls():
        return await asyncio.gather(*(litellm.acompletion(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=max_tokens, **kw)
                                      for q in QUESTIONS))

    return asyncio.run(calls())


def test_required_tool_choice_gives_16_valid_calls() -> None:
    names = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for r in _all(tools=TOOLS, tool_choice="required"):
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0]
        for call in calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in names and set(names[call.function.name]["required"]) <= set(args)


def test_json_schema_gives_16_valid_objects() -> None:
    schema = {"type": "object", "properties": {
        "destination": {"type": "string", "maxLength": 30}, "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "packing": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "budget": {"type": "object", "properties": {"currency": {"enum": ["USD", "EUR"]}, "amount": {"type": "integer", "minimum": 0, "maximum": 100000}},
                   "required": ["currency", "amount"]}},
        "required": ["destination", "days", "packing", "budget"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema}}
    for r in _all(max_tokens=200, response_format=fmt):
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"destination", "days", "packing", "budget"} and 1 <= value["days"] <= 30
        assert value["budget"]["currency"] in ("USD", "EUR") and isinstance(value["budget"]["amount"], int)
