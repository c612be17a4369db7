"""vLLM's ``structured_outputs`` request field to a decoding constraint.

A client written for vLLM asks for structured output with
``extra_body={"structured_outputs": {"choice": [...]}}`` (or ``regex``, ``json``,
``grammar``, ``json_object``); vLLM before 0.12 took the same as ``guided_choice``,
``guided_regex``, ``guided_json`` and ``guided_grammar``, which the LiteLLM adapter turns into
this mapping. One kind per request, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

from ..engine import Constraint
from ..errors import InvalidParameterError
from .constraints import closed_objects

#: The kinds of ``structured_outputs`` this package honours (vLLM's names).
KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: vLLM's keys that tune its own grammar backends: accepted, nothing to do here.
_BACKEND_KEYS = frozenset(("disable_fallback", "disable_any_whitespace"))


def structured_outputs_constraint(spec: Any) -> Optional[Constraint]:
    """The constraint of a ``structured_outputs`` mapping (None for None); one of
    :data:`KINDS` must be set. JSON schemas get ``"additionalProperties": false`` on objects
    that do not say (what vLLM's default grammar backend does too). Raises
    :class:`InvalidParameterError` naming the field."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise InvalidParameterError("structured_outputs", f"must be a dict with one of {', '.join(KINDS)}, got {type(spec).__name__}")
    unknown = [k for k in spec if k not in KINDS and k not in _BACKEND_KEYS]
    if unknown:
        raise InvalidParameterError(f"structured_outputs.{unknown[0]}", f"is not supported; give one of {', '.join(KINDS)}")
    given = [k for k in KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidParameterError(
            "structured_outputs", f"needs exactly one of {', '.join(KINDS)}, got {', '.join(given) if given else 'none'}"
        )
    kind = given[0]
    value = spec[kind]
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = _parsed(value)
            return Constraint.json_schema(closed_objects(schema, field) if isinstance(schema, Mapping) else schema)
        if kind == "json_object":
            if value is not True:
                raise InvalidParameterError(field, f"must be true, got {value!r}")
            return Constraint.json_object()
        if kind == "regex":
            if not isinstance(value, str):
                raise InvalidParameterError(field, f"must be a string, got {type(value).__name__}")
            return Constraint.regex(value)
        if kind == "choice":
            return Constraint.choice(value)
        return Constraint.gbnf(value)
    except InvalidParameterError as error:
        if error.field.startswith("structured_outputs"):
            raise
        # Named as the request named it: "choice[1]" -> "structured_outputs.choice[1]".
        index = error.field[len(kind):] if error.field.startswith(kind + "[") else ""
        raise InvalidParameterError(field + index, str(error)[len(error.field) + 2:]) from None


def _parsed(schema: Any) -> Any:
    """A schema given as JSON text, parsed (so its objects are closed too); text that does not
    parse is left for :meth:`Constraint.json_schema` to refuse."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except (ValueError, RecursionError):
        return schema
