"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a
list of strings, or a Lark or GBNF grammar (:class:`Constraint`), compiled by llguidance.
No MLX here; the worker side is :mod:`.guided`.

A constraint's text is checked against :data:`~.grammar_limits.LIMITS` first; llguidance
then converts and validates it on a compiler thread (:mod:`.build_threads`, a large stack), once
per distinct constraint (:func:`compiled_grammar` caches by content)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._validation import check_nested
from ...errors import InvalidParameterError
from .build_threads import run_compiler
from .limits import LIMITS, check_grammar_input

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
    is checked and compiled on construction (a bad one, or one over a limit of
    :class:`~.grammar_limits.GrammarLimits`, is an :class:`InvalidParameterError`)."""

    kind: str
    value: str = ""
    #: The whole output is JSON (or tool calls of JSON): near ``max_tokens`` the row is steered
    #: to close what it opened rather than be cut (JSON kinds; a Lark grammar says so).
    json_output: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidParameterError("constraint", f"kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise InvalidParameterError("constraint", f"{self.kind} must be a string, got {type(self.value).__name__}")
        check_grammar_input(self.kind, self.value)
        self.grammar()

    @classmethod
    def json_schema(cls, schema: Any) -> "Constraint":
        """Output is JSON valid against ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise InvalidParameterError("json_schema", f"nests too deep (limit {LIMITS.max_depth} levels)") from None
            except ValueError as error:
                raise InvalidParameterError("json_schema", f"is not JSON: {error}") from None
        if not isinstance(schema, dict):
            raise InvalidParameterError("json_schema", f"must be a JSON object, got {type(schema).__name__}")
        check_nested("json_schema", schema, LIMITS.max_depth, "GrammarLimits.max_depth")  # before json.dumps recurses
        try:
            text = json.dumps(schema)
        except RecursionError:
            raise InvalidParameterError("json_schema", f"nests too deep (limit {LIMITS.max_depth} levels)") from None
        except (TypeError, ValueError) as error:
            raise InvalidParameterError("json_schema", f"is not JSON: {error}") from None
        return cls("json_schema", text, json_output=True)

    @classmethod
    def json_object(cls) -> "Constraint":
        """Output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object", json_output=True)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Output matches ``pattern`` in full."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str, json_output: bool = False) -> "Constraint":
        """Output is a sentence of a Lark grammar (llguidance's dialect, which can embed
        JSON schemas with ``%json {...}``); ``json_output``: every sentence is JSON or
        literals around it (see :attr:`json_output`)."""
        return cls("lark", grammar, json_output=json_output)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Constraint":
        """Output is exactly one of ``options`` (vLLM's ``choice``)."""
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
            raise InvalidParameterError("choice", f"must be a non-empty list of strings, got {options!r:.80}")
        for i, option in enumerate(options):
            if not isinstance(option, str):
                raise InvalidParameterError(f"choice[{i}]", f"must be a string, got {type(option).__name__}")
        return cls("lark", "start: " + " | ".join(json.dumps(option) for option in options))

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """Output is a sentence of a GBNF grammar (llama.cpp's EBNF dialect, ``root ::= ...``;
        what vLLM's ``grammar`` takes) or of a Lark grammar, which passes as is."""
        if not isinstance(grammar, str):
            raise InvalidParameterError("grammar", f"must be a string, got {type(grammar).__name__}")
        check_grammar_input("lark", grammar)  # size and bracket nesting, before the converter recurses
        return cls("lark", run_compiler(_gbnf_to_lark, grammar))

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (validated; cached by content)."""
        return compiled_grammar(self.kind, self.value)


def compiled_grammar(kind: str, value: str) -> str:
    """The validated llguidance grammar of a constraint's ``kind`` and ``value``, converted
    on a compiler thread once per distinct pair; raises :class:`InvalidParameterError`."""
    key = (kind, value)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
    if hit is None:
        hit = run_compiler(_convert_and_validate, kind, value)
        _remember(key, hit)
    grammar, field, error = hit
    if error:
        raise InvalidParameterError(field, error)
    return grammar


#: Characters of constraint text and grammar the cache of :func:`compiled_grammar` keeps.
CACHE_CHARS = 32 << 20
#: ``(kind, value) -> (grammar, "", "")`` or ``("", field, error)``: a bad grammar sent
#: again is not compiled again either. Least recently used first.
_cache: "OrderedDict[tuple[str, str], tuple[str, str, str]]" = OrderedDict()
_cache_chars = 0
_cache_lock = threading.Lock()


def _remember(key: tuple[str, str], entry: tuple[str, str, str]) -> None:
    global _cache_chars
    size = len(key[1]) + len(entry[0]) + len(entry[2])
    with _cache_lock:
        if key in _cache or size > CACHE_CHARS:
            return
        _cache[key] = entry
        _cache_chars += size
        while _cache_chars > CACHE_CHARS:
            (_, old_value), (old_grammar, _, old_error) = _cache.popitem(last=False)
            _cache_chars -= len(old_value) + len(old_grammar) + len(old_error)


def _convert_and_validate(kind: str, value: str) -> tuple[str, str, str]:
    matcher = import_llguidance().LLMatcher
    if kind == "json_schema":
        try:
            grammar = matcher.grammar_from_json_schema(value, defaults=JSON_STYLE)
        except ValueError as error:
            return "", "json_schema", str(error)
    elif kind == "json_object":
        grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(value)
    else:
        grammar = matcher.grammar_from_lark(value)
    error = matcher.validate_grammar(grammar)
    return ("", f"constraint ({kind})", error.strip().splitlines()[0]) if error else (grammar, "", "")


def _gbnf_to_lark(grammar: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except RecursionError:
        raise InvalidParameterError("grammar", f"nests too deep (limit {LIMITS.max_depth} levels)") from None
    except Exception as error:  # the converter's own GbnfToLarkError, or a ValueError of its parser
        raise InvalidParameterError("grammar", f"is not a GBNF or Lark grammar: {error}") from None


def import_llguidance() -> Any:
    """The llguidance module, or an InvalidParameterError saying to install it."""
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a declared dependency
        raise InvalidParameterError("constraint", "structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance
