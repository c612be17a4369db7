"""Decoding constraints for a chat request: what makes JSON output and forced tool calls
hold by construction instead of by prompting alone.

* ``response_format`` ``json_object`` / ``json_schema`` -> a JSON (schema) constraint;
  ``json_object`` with a ``schema`` (Fireworks' and Together's extension, what LangChain's
  ``json_mode`` with a schema sends) -> that schema.
* ``tool_choice`` ``"required"`` or a named function, when the prompt asks for the Hermes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format -> a grammar that
  allows only such calls, each ``arguments`` valid against its tool's parameter schema.

* ``tool_choice="auto"`` -> text is free until the model opens ``<tool_call>``; the call is
  constrained from there (a lazy grammar), so a call that starts always parses.

Tool formats other than Hermes (templates that render tools natively in another format)
stay unconstrained. The prompt instructions stay too: they tell the model what the grammar
will enforce.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .._validation import check_nested
from ..engine import Constraint
from ..engine.grammar.constraint import JSON_STYLE
from ..engine.grammar.limits import LIMITS
from ..errors import InvalidParameterError
from .tool_defs import TOOL_CALL_END, TOOL_CALL_START
from .tool_formats import HERMES_FORMAT, ToolCallFormat

logger = logging.getLogger(__name__)


def response_format_constraint(response_format: Any) -> Optional[Constraint]:
    """The constraint for an OpenAI ``response_format`` (None for text or none).
    Call after :func:`~.prepare.response_format_instruction` has validated it."""
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is None:
            return Constraint.json_object()
        try:
            return Constraint.json_schema(closed_objects(schema))
        except InvalidParameterError as error:
            raise InvalidParameterError("response_format.schema", str(error)) from None
    if kind == "json_schema":
        spec = response_format["json_schema"]
        schema = spec.get("schema", spec) if isinstance(spec, Mapping) else spec
        try:
            return Constraint.json_schema(closed_objects(schema))
        except InvalidParameterError as error:
            raise InvalidParameterError("response_format.json_schema", str(error)) from None
    return None


def tool_call_constraint(
    tools: Optional[Sequence[Mapping[str, Any]]], forced: bool, tool_format: ToolCallFormat, parallel: bool,
    special_start: bool = False, answer: Optional[Constraint] = None,
) -> Optional[Constraint]:
    """The grammar of Hermes tool calls to ``tools``, or None when the prompt asked for
    another format or offers no tools.

    When a call is ``forced``, only calls may be written (one, or if ``parallel`` up to one
    per tool, in a row). Otherwise (``tool_choice="auto"``) text is free until the model
    writes ``<tool_call>``; from there the call is constrained (a lazy grammar), then text
    is free again; with an ``answer`` constraint (a JSON ``response_format``) the output is
    either calls or that answer. ``special_start``: ``<tool_call>`` is one special token of
    the tokenizer. Objects in the argument schemas are closed (:func:`closed_objects`).
    A forced call whose grammar does not compile is an :class:`InvalidParameterError`; an
    optional one falls back to prompting alone, logged.
    """
    if not tools or tool_format.name != HERMES_FORMAT.name:
        return None
    defs: dict[str, Any] = {}
    schema: dict[str, Any] = {"x-guidance": JSON_STYLE, "anyOf": [_call_schema(t["function"], f"tool{i}", defs) for i, t in enumerate(tools)]}
    if defs:
        schema["$defs"] = defs
    answer_schema = _answer_schema(answer)
    if forced or answer_schema is not None:
        start, end, newline = json.dumps(TOOL_CALL_START + "\n"), json.dumps("\n" + TOOL_CALL_END), json.dumps("\n")
        call = f"{start} %json {json.dumps(schema)} {end}"
        # At most one call per tool offered: small models, once free to go on, repeat the
        # same call until max_tokens runs out.
        more = f" ({newline} call){{0,{len(tools) - 1}}}" if parallel and len(tools) > 1 else ""
        rules = f"call{more}\ncall: {call}\n"
        grammar = f"start: {rules}" if forced else f"start: calls | answer\ncalls: {rules}answer: %json {json.dumps(answer_schema)}\n"
    else:
        from llguidance import StructTag

        tag = StructTag(trigger=TOOL_CALL_START, begin=TOOL_CALL_START + "\n", grammar=schema, end="\n" + TOOL_CALL_END)
        grammar = StructTag.to_grammar([tag], assume_special=special_start)
    try:
        return Constraint.lark(grammar, json_output=forced or answer_schema is not None)  # no free text
    except InvalidParameterError as error:
        if forced:
            raise InvalidParameterError("tools", f"the forced tool call's grammar does not compile: {error}") from None
        logger.warning("tool calls are prompted only: their grammar did not compile (%s)", error)
        return answer


def _answer_schema(answer: Optional[Constraint]) -> Optional[dict[str, Any]]:
    """The JSON schema of a ``response_format`` constraint, to embed beside tool calls."""
    if answer is None:
        return None
    schema = {"type": "object"} if answer.kind == "json_object" else json.loads(answer.value)
    return {"x-guidance": JSON_STYLE, **schema}


def closed_objects(schema: Any, field: str = "json_schema") -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object that lists its
    ``properties`` and says nothing of extra ones, as OpenAI's strict mode requires. Without
    it a small model, free to add keys, tends to copy the schema into its answer until
    ``max_tokens`` runs out. A schema nested more than ``GrammarLimits.max_depth`` levels is an
    :class:`InvalidParameterError` naming ``field``, checked before recursing into it."""
    check_nested(field, schema, LIMITS.max_depth, "GrammarLimits.max_depth")
    return _closed(schema)


def _closed(schema: Any) -> Any:
    if isinstance(schema, Mapping):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _call_schema(function: Mapping[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """One tool's call object. Parameters that use ``$ref`` (pydantic's ``$defs``, a
    recursive ``#``) keep resolving once nested under ``arguments``: they move to
    ``defs[key]`` with every local reference rebased there."""
    parameters = closed_objects(function.get("parameters") or {"type": "object"}, f"tools ({function['name']}).parameters")
    if _has_local_ref(parameters):
        defs[key] = _rebased(parameters, f"#/$defs/{key}")
        parameters = {"$ref": f"#/$defs/{key}"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, Mapping):
        ref = schema.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_local_ref(v) for v in schema)


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#``, ``#/$defs/X``, any JSON pointer) under ``base``."""
    if isinstance(schema, Mapping):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema
