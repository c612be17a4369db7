"""Checks of a constraint's text before llguidance sees it.

llguidance converts and validates grammars recursively, in Rust, on the calling thread's
stack: a flat 95 KB JSON schema whose ``$defs`` chain 1,000 ``$ref`` s, or a Lark grammar of
3,000 chained rules, overflowed the stack and killed the process. Grammars are compiled on
threads with a large stack (:mod:`.build_threads`); these limits keep what reaches them far
inside it, and name what a caller must change. They are generous for real schemas
(OpenAI's strict mode allows 10 levels of nesting and 5,000 properties). Pure Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from ...errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """The largest constraint accepted, by measure (each exceeded one is a 400)."""

    max_bytes: int = 1 << 20
    """Size of the schema, regex or grammar text (UTF-8 bytes)."""
    max_depth: int = 128
    """Nesting of a JSON schema's values (objects and arrays) or of a grammar's brackets."""
    max_defs: int = 2_000
    """Entries of a JSON schema's ``$defs`` / ``definitions``."""
    max_ref_chain: int = 128
    """``$ref`` s followed one after another from the schema's root (recursion stops a chain)."""
    max_lark_rules: int = 2_000
    """Rules and terminals of a Lark grammar."""


LIMITS = GrammarLimits()

_LARK_RULE = re.compile(r"(?:^|\n|\\n)[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?[ \t]*:(?!:)")
_LARK_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|/(?:\\.|[^/\\\n])+/')
_JSON_DIRECTIVE = re.compile(r"%json\s*")


def check_grammar_input(kind: str, value: str, limits: GrammarLimits = LIMITS) -> None:
    """Raise :class:`InvalidParameterError` naming the limit if ``value`` (the text of a
    constraint of ``kind``) exceeds one of ``limits``."""
    field = f"constraint ({kind})"
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        _refuse(field, f"is {size:,} bytes", "max_bytes", limits.max_bytes)
    if kind == "json_schema":
        check_json_schema(field, value, limits)
    elif kind == "lark":
        _check_lark(field, value, limits)


def check_json_schema(field: str, text: str, limits: GrammarLimits = LIMITS) -> None:
    """Nesting depth, ``$defs`` count and ``$ref`` chain length of a JSON schema's text."""
    try:
        schema = json.loads(text)
    except RecursionError:
        _refuse(field, "nests deeper than Python's JSON parser goes", "max_depth", limits.max_depth)
    except ValueError:
        return  # llguidance says what is wrong with it
    _check_schema(field, schema, limits)


def _check_schema(field: str, schema: Any, limits: GrammarLimits) -> None:
    depth = _json_depth(schema)
    if depth > limits.max_depth:
        _refuse(field, f"nests {depth} levels deep", "max_depth", limits.max_depth)
    if not isinstance(schema, dict):
        return
    defs = {f"#/{key}/{name}": body for key in ("$defs", "definitions")
            if isinstance(schema.get(key), dict) for name, body in schema[key].items()}
    if len(defs) > limits.max_defs:
        _refuse(field, f"has {len(defs):,} $defs", "max_defs", limits.max_defs)
    chain = _longest_ref_chain(schema, defs)
    if chain > limits.max_ref_chain:
        _refuse(field, f"has a chain of {chain:,} $refs", "max_ref_chain", limits.max_ref_chain)


def _check_lark(field: str, text: str, limits: GrammarLimits) -> None:
    rules = len(_LARK_RULE.findall(text))
    if rules > limits.max_lark_rules:
        _refuse(field, f"has {rules:,} rules", "max_lark_rules", limits.max_lark_rules)
    decoder = json.JSONDecoder()
    for match in _JSON_DIRECTIVE.finditer(text):  # embedded JSON schemas (``%json {...}``)
        try:
            schema, _ = decoder.raw_decode(text, match.end())
        except RecursionError:
            _refuse(field, "embeds a JSON schema nested deeper than Python's JSON parser goes", "max_depth", limits.max_depth)
        except ValueError:
            continue
        _check_schema(field, schema, limits)
    depth = _bracket_depth(_LARK_STRING.sub('""', text))
    if depth > limits.max_depth:
        _refuse(field, f"nests brackets {depth} levels deep", "max_depth", limits.max_depth)


def _refuse(field: str, what: str, limit: str, value: int) -> None:
    raise InvalidParameterError(field, f"{what}, over the limit of {value:,} (GrammarLimits.{limit})")


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        yield from node.values()
    elif isinstance(node, list):
        yield from node


def _json_depth(root: Any) -> int:
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in _children(node))
    return deepest


def _refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` string inside ``node`` (not into nested ``$defs`` of the root)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            yield node["$ref"]
        stack.extend(_children(node))


def _longest_ref_chain(schema: dict[str, Any], defs: dict[str, Any]) -> int:
    """Most ``$ref`` hops from the root through ``defs``, a cycle ending a chain."""
    root = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    targets = {name: [r for r in _refs(body) if r in defs] for name, body in defs.items()}
    longest: dict[str, int] = {}
    on_path: set[str] = set()
    for start in [r for r in _refs(root) if r in defs]:
        if start in longest:
            continue
        stack = [(start, iter(targets[start]))]
        on_path.add(start)
        while stack:  # depth-first, iteratively: the chain may be longer than Python's stack
            name, pending = stack[-1]
            for target in pending:
                if target not in on_path and target not in longest:
                    stack.append((target, iter(targets[target])))
                    on_path.add(target)
                    break
            else:
                longest[name] = 1 + max((longest[t] for t in targets[name] if t in longest), default=0)
                stack.pop()
                on_path.discard(name)
    return max((longest.get(r, 0) for r in _refs(root)), default=0)


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for char in re.findall(r"[\[\](){}]", text):
        if char in "[({":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest
