"""The chat layer's decoding constraints (issue 11): which requests get one, and its shape."""

from __future__ import annotations

import json
import re

import pytest

from fakes import TIME, WEATHER
from mlx_parallm_provider.chat.constraints import closed_objects, response_format_constraint, tool_call_constraint
from mlx_parallm_provider.chat.tool_formats import HERMES_FORMAT
from mlx_parallm_provider.errors import InvalidParameterError


def test_closed_objects_closes_every_object_that_does_not_say() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "properties": {}, "additionalProperties": True}},
              "anyOf": [{"properties": {"d": {}}}]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True  # said explicitly: kept
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_forced_calls_are_capped_at_one_per_tool() -> None:
    two = tool_call_constraint([WEATHER, TIME], forced=True, tool_format=HERMES_FORMAT, parallel=True)
    assert re.search(r"call\)\{0,1\}", two.value)
    one = tool_call_constraint([WEATHER, TIME], forced=True, tool_format=HERMES_FORMAT, parallel=False)
    assert one.value.startswith("start: call\n")


def _accepts(constraint, tokenizer, text: str) -> bool:
    """Whether ``text`` followed by EOS is a sentence of the constraint's grammar."""
    from mlx_parallm_provider.engine.grammar.guided import GrammarTokenizer, RowMatcher

    grammar = GrammarTokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    matcher = RowMatcher(constraint, grammar).matcher
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.consume_token(tokenizer.eos_token_id)


def test_auto_leaves_text_free_until_a_call_opens_and_then_the_call_must_parse(tiny_model) -> None:
    auto = tool_call_constraint([WEATHER, TIME], forced=False, tool_format=HERMES_FORMAT, parallel=True)
    tok = tiny_model.tokenizer
    assert _accepts(auto, tok, "Plain text, even a < b, and no call.")
    assert _accepts(auto, tok, 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _accepts(auto, tok, '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>')
    assert not _accepts(auto, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>')


def test_text_response_format_has_no_constraint() -> None:
    assert response_format_constraint(None) is None and response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}).kind == "json_object"


def test_json_is_spaced_as_json_dumps_writes_it(tiny_model) -> None:
    # Models write JSON with ", " and ": " (and were shown it so in the tool prompt); forced
    # compact, a small model followed `{"input":` with a schema instead of a value.
    from mlx_parallm_provider.engine import Constraint

    tok = tiny_model.tokenizer
    schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                     "required": ["a", "b"]})
    assert _accepts(schema, tok, '{"a": 1, "b": "x"}')
    assert not _accepts(schema, tok, '{"a":1,"b":"x"}')
    assert not _accepts(schema, tok, '{"a": 1,  "b": "x"}')
    assert _accepts(Constraint.json_object(), tok, '{"a": [1, 2], "b": {"c": null}}')
    forced = tool_call_constraint([WEATHER], forced=True, tool_format=HERMES_FORMAT, parallel=False)
    assert _accepts(forced, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_json_object_with_a_schema_is_held_to_the_schema(tiny_model) -> None:
    # LangChain's json_mode with a schema sends this (Fireworks' and Together's form).
    constraint = response_format_constraint({"type": "json_object", "schema": PERSON})
    tok = tiny_model.tokenizer
    assert constraint.kind == "json_schema"
    assert _accepts(constraint, tok, '{"name": "Ann", "age": 7}')
    assert not _accepts(constraint, tok, '{"name": "Ann"}')  # a required key missing
    assert not _accepts(constraint, tok, '{"name": "Ann", "age": 7, "x": 1}')  # closed, as json_schema is
    assert _accepts(response_format_constraint({"type": "json_object"}), tok, '{"name": "Ann"}')


def test_json_object_with_a_bad_schema_names_the_field() -> None:
    with pytest.raises(InvalidParameterError) as info:
        response_format_constraint({"type": "json_object", "schema": {"type": "no-such-type"}})
    assert info.value.field == "response_format.schema"


# Issue 21 items 7 and 11: schemas as pydantic writes them; JSON answers beside tools.

def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


PET_TOOL = _tool("adopt", {  # pydantic's model_json_schema() of a model with a nested model
    "$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}, "kind": {"enum": ["cat", "dog"]}},
                      "required": ["name", "kind"], "title": "Pet"}},
    "type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"], "title": "Adopt"})
TREE_TOOL = _tool("plant", {  # a recursive schema: the root refers to itself
    "type": "object", "properties": {"label": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["label", "kids"]})


@pytest.mark.parametrize("forced", [True, False])
def test_refs_in_tool_schemas_resolve_once_nested_under_arguments(tiny_model, forced: bool) -> None:
    constraint = tool_call_constraint([PET_TOOL, TREE_TOOL, WEATHER], forced=forced, tool_format=HERMES_FORMAT, parallel=True)
    tok = tiny_model.tokenizer
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format
    assert _accepts(constraint, tok, call("adopt", '{"pet": {"name": "Rex", "kind": "dog"}}'))
    assert not _accepts(constraint, tok, call("adopt", '{"pet": {"name": "Rex", "kind": "cow"}}'))
    assert not _accepts(constraint, tok, call("adopt", '{"pet": {"name": "Rex"}}'))
    assert _accepts(constraint, tok, call("plant", '{"label": "a", "kids": [{"label": "b", "kids": []}]}'))
    assert not _accepts(constraint, tok, call("plant", '{"label": "a", "kids": [{"label": "b"}]}'))
    assert _accepts(constraint, tok, call("get_weather", '{"city": "Oslo"}'))
    assert "$ref" not in json.dumps(tool_call_constraint([WEATHER], forced=forced, tool_format=HERMES_FORMAT, parallel=True).value)


def test_a_json_response_format_beside_optional_tools_allows_calls_or_that_answer(tiny_model) -> None:
    answer = response_format_constraint({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    either = tool_call_constraint([WEATHER], forced=False, tool_format=HERMES_FORMAT, parallel=False, answer=answer)
    tok = tiny_model.tokenizer
    assert _accepts(either, tok, '{"name": "Ann", "age": 7}')
    assert _accepts(either, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _accepts(either, tok, "Ann is 7.")
    assert not _accepts(either, tok, '{"name": "Ann"}')


def test_a_forced_call_whose_grammar_does_not_compile_is_a_bad_request() -> None:
    broken = _tool("broken", {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}})
    with pytest.raises(InvalidParameterError) as info:
        tool_call_constraint([broken], forced=True, tool_format=HERMES_FORMAT, parallel=False)
    assert info.value.field == "tools" and "Missing" in str(info.value)
    assert tool_call_constraint([broken], forced=False, tool_format=HERMES_FORMAT, parallel=False) is None  # prompted, logged


def test_vllm_structured_outputs_make_the_constraint_each_kind_names() -> None:
    from mlx_parallm_provider.chat import structured_outputs_constraint
    from mlx_parallm_provider.engine import Constraint

    assert structured_outputs_constraint(None) is None
    assert structured_outputs_constraint({"choice": ["a b", 'say "hi"']}) == Constraint.lark('start: "a b" | "say \\"hi\\""')
    assert structured_outputs_constraint({"regex": "[0-9]+", "disable_fallback": True}) == Constraint.regex("[0-9]+")
    assert structured_outputs_constraint({"json_object": True}) == Constraint.json_object()
    made = structured_outputs_constraint({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    assert made.kind == "json_schema" and json.loads(made.value)["additionalProperties"] is False
    assert structured_outputs_constraint({"json": '{"type": "integer"}'}) == Constraint.json_schema({"type": "integer"})
    as_text = structured_outputs_constraint({"json": '{"type": "object", "properties": {"a": {}}}'})
    assert json.loads(as_text.value)["additionalProperties"] is False  # JSON text is closed as a dict is
    gbnf = structured_outputs_constraint({"grammar": 'root ::= "x" [0-9]'})
    assert gbnf.kind == "lark" and "start" in gbnf.value and "::=" not in gbnf.value
    assert Constraint.gbnf('start: "x"') == Constraint.lark('start: "x"')  # Lark passes as is


@pytest.mark.parametrize("spec,field", [
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"choice": [None]}, "structured_outputs.choice[0]"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"grammar": "root ::= " + "(" * 300 + '"a"' + ")" * 300}, "structured_outputs.grammar"),  # over the nesting limit
    ({"grammar": "no rules here"}, "structured_outputs.grammar"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
    ({"regex": "a", "json_object": True}, "structured_outputs"),
])
def test_bad_vllm_structured_outputs_name_their_field(spec: dict, field: str) -> None:
    from mlx_parallm_provider.chat import structured_outputs_constraint

    with pytest.raises(InvalidParameterError) as caught:
        structured_outputs_constraint(spec)
    assert caught.value.field == field, str(caught.value)
