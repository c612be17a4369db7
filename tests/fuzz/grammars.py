"""Hypothesis strategies of constraints: JSON schemas (nested objects, arrays, enums,
``$defs`` / ``$ref`` with cycles and dangling references, ``anyOf``, patterns, bounds, some
contradictory), small regexes and small Lark grammars (recursive rules, embedded
``%json``, special tokens), valid and not, for ``fuzz_constraints.py``."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from fuzzing import mostly

NAMES = st.sampled_from(["a", "b", "city", "n", "x y", "\u00fc", "$ref"])
#: Patterns valid for llguidance and Python's ``re`` alike; then some valid for neither.
PATTERNS = mostly(st.sampled_from(["^[a-z]{1,3}$", "[0-9]+", "^(ab)*$", "^(yes|no)$", "^[0-9]{2}-[0-9]{2}$", "^.{0,4}$"]),
                  st.sampled_from(["^[^\\s\\S]$", "(", "^x{2,1}$", "[a-"]))
REFS = mostly(st.sampled_from(["#", "#/$defs/d0", "#/$defs/d1"]),
              st.sampled_from(["#/$defs/missing", "#/properties/a", "http://example.com/x.json"]))
SMALL = st.integers(-20, 20)
SCALARS = st.one_of(st.none(), st.booleans(), SMALL, st.floats(-5, 5, allow_nan=False), st.text(max_size=4))


def _optional(fixed: dict[str, Any], /, **optional: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({k: st.just(v) for k, v in fixed.items()}, optional=optional)


LEAVES = mostly(
    st.one_of(
        _optional({"type": "string"}, minLength=st.integers(0, 4), maxLength=st.integers(0, 8), pattern=PATTERNS),
        _optional({"type": "integer"}, minimum=SMALL, maximum=SMALL, exclusiveMinimum=SMALL, multipleOf=st.integers(1, 5)),
        _optional({"type": "number"}, minimum=st.floats(-5, 5), maximum=st.floats(-5, 5)),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, {"type": ["string", "null"]}]),
        st.builds(lambda values: {"enum": values}, st.lists(SCALARS, min_size=1, max_size=4, unique_by=repr)),
        st.builds(lambda value: {"const": value}, SCALARS),
        st.builds(lambda ref: {"$ref": ref}, REFS),
    ),
    st.sampled_from([{"not": {}}, {"type": "string", "format": "date"}, {"type": "nonsense"}, {"enum": []}]),
)


def _object(props: dict[str, Any]) -> st.SearchStrategy:
    keys = sorted(props)
    return _optional({"type": "object", "properties": props},
                     required=st.lists(st.sampled_from(keys), unique=True) if keys else st.just([]),
                     additionalProperties=st.booleans())


def _composites(children: st.SearchStrategy) -> st.SearchStrategy:
    return mostly(
        st.one_of(
            st.dictionaries(NAMES, children, max_size=4).flatmap(_object),
            st.builds(lambda items, extra: {"type": "array", "items": items, **extra}, children,
                      st.fixed_dictionaries({}, optional={"minItems": st.integers(0, 3), "maxItems": st.integers(0, 4)})),
            st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=1, max_size=3)),
        ),
        st.one_of(  # what llguidance supports only in part
            st.builds(lambda a, b: {"allOf": [a, b]}, children, children),
            st.builds(lambda options: {"oneOf": options}, st.lists(children, min_size=1, max_size=2)),
            st.builds(lambda props, least: {"type": "object", "properties": props, "minProperties": least},
                      st.dictionaries(NAMES, children, max_size=3), st.integers(0, 3)),
        ),
    )


SCHEMA_BODIES = st.recursive(LEAVES, _composites, max_leaves=8)

json_schemas = st.builds(
    lambda body, defs: {**body, "$defs": defs} if defs else body,
    SCHEMA_BODIES,
    mostly(st.fixed_dictionaries({"d0": SCHEMA_BODIES, "d1": SCHEMA_BODIES}), st.just({})),
)
"""A JSON schema: its body, maybe with ``$defs`` that its ``$ref`` s (and each other's) name."""

_ATOMS = st.sampled_from(["a", "b", "[a-c]", "[0-9]", ".", "[^\\s\\S]", "(yes|no)", " ", "\\.", "\u00e9", "[", "(", "x{3,1}"])

regexes = st.recursive(
    _ATOMS,
    lambda r: st.one_of(
        st.tuples(r, r).map("".join),
        st.tuples(r, r).map(lambda p: f"({p[0]}|{p[1]})"),
        st.tuples(r, st.sampled_from(["*", "+", "?", "{1,3}", "{2}"])).map(lambda p: f"({p[0]}){p[1]}"),
    ),
    max_leaves=6,
)
"""A small regex, sometimes invalid (an open bracket, ``x{3,1}``) or unsatisfiable."""

_LARK_ITEMS = st.one_of(
    st.sampled_from(['"a"', '"yes"', '" "', "/[a-z]+/", "/[0-9]{1,3}/", "start", "r1", "r2", "r9", "<|endoftext|>",
                     "<|no_such_token|>", '""', "/(/"]),
    st.builds(lambda body: f"%json {body}", st.sampled_from(['{"type": "integer"}', '{"$ref": "#"}',
                                                           '{"type": "array", "items": {"$ref": "#"}, "minItems": 1}'])),
    st.builds(lambda schema: f"%json {json.dumps(schema)}", SCHEMA_BODIES),
)
_LARK_SEQUENCES = st.lists(
    st.tuples(_LARK_ITEMS, st.sampled_from(["", "", "?", "*", "+"])).map(lambda p: "".join(p) if p[1] == "" or not p[0].startswith("%") else p[0]),
    min_size=1, max_size=3,
).map(" ".join)
_LARK_RULES = st.lists(_LARK_SEQUENCES, min_size=1, max_size=3).map(" | ".join)

lark_grammars = st.builds(
    lambda start, others: "\n".join([f"start: {start}", *(f"r{i + 1}: {body}" for i, body in enumerate(others))]),
    _LARK_RULES, st.lists(_LARK_RULES, max_size=2),
)
"""A small Lark grammar: ``start`` and up to two more rules, which may recurse, name a rule
that does not exist, embed JSON schemas (some endless) or special tokens (some unknown)."""
