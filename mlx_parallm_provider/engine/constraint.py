"""What a request's output must match: a JSON schema, any JSON object, a regex or a Lark
grammar (:class:`Constraint`), compiled by llguidance. No MLX here; the worker side is
:mod:`.guided`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParameterError

_KINDS = ("json_schema", "json_object", "regex", "lark")
#: How constrained JSON is spaced: no free whitespace (a model cannot stall in endless
#: blanks), one space after ``:`` and ``,`` as ``json.dumps`` writes it, which is how
#: models write JSON (forced compact, a small model loses its way: ``{"input":`` is followed
#: by a schema where ``{"input": `` is followed by the value). A schema may ask otherwise
#: through llguidance's ``"x-guidance"`` key.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. Build one with the class methods; the grammar
    is compiled and checked on construction (a bad one is an :class:`InvalidParameterError`)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidParameterError("constraint", f"kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise InvalidParameterError("constraint", f"{self.kind} must be a string, got {type(self.value).__name__}")
        error = import_llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise InvalidParameterError(f"constraint ({self.kind})", error.strip().splitlines()[0])

    @classmethod
    def json_schema(cls, schema: Any) -> "Constraint":
        """Output is JSON valid against ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise InvalidParameterError("json_schema", f"is not JSON: {error}") from None
        if not isinstance(schema, dict):
            raise InvalidParameterError("json_schema", f"must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Output matches ``pattern`` in full."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """Output is a sentence of a Lark grammar (llguidance's dialect, which can embed
        JSON schemas with ``%json {...}``)."""
        return cls("lark", grammar)

    def grammar(self) -> str:
        """The llguidance grammar of this constraint."""
        matcher = import_llguidance().LLMatcher
        if self.kind == "json_schema":
            try:
                return matcher.grammar_from_json_schema(self.value, defaults=JSON_STYLE)
            except ValueError as error:
                raise InvalidParameterError("json_schema", str(error)) from None
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.value)
        return matcher.grammar_from_lark(self.value)


def import_llguidance() -> Any:
    """The llguidance module, or an InvalidParameterError saying to install it."""
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a declared dependency
        raise InvalidParameterError("constraint", "structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance
