"""Constraints are checked against limits before llguidance sees them, compiled on a thread
with a large stack, and compiled once per content (issue 21, item 1).

Schemas and grammars that overflowed the stack killed the process (SIGSEGV), so those run
in a subprocess: a crash is a failed test, not a dead pytest."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import types
from pathlib import Path

import pytest

from early import Command, result
from fakes import make_tokenizer
from mlx_parallm_provider.engine import Constraint
from mlx_parallm_provider.engine.grammar import constraint as constraint_module
from mlx_parallm_provider.engine.grammar import guided
from mlx_parallm_provider.engine.grammar.limits import GrammarLimits, check_grammar_input
from mlx_parallm_provider.errors import InvalidParameterError

TESTS = Path(__file__).resolve().parents[1]


def ref_chain(n: int) -> dict:
    """A flat schema whose ``$defs`` chain ``n`` objects, each one property of the next
    (1,000 of them: the 95 KB body that killed the proxy)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def _child(code: str) -> Command:
    """``code`` in a fresh interpreter that imports from the tests' folders."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS / "unit"), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    return Command([sys.executable, "-c", code], env=env, timeout=300)


def _lines(request: pytest.FixtureRequest) -> list[str]:
    """The output lines of the test's child, started early (the test fails on a crash)."""
    out = result(request)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout.strip().splitlines()


DEEP_REFS = """
import json, litellm, mlx_parallm_provider
from fakes import FakeEngine
from mlx_parallm_provider.integrations import litellm as adapter
from test_grammar_limits import ref_chain
engine = FakeEngine()
adapter.get_engine = lambda model="default", config=None: engine
for n in (1_000, 10_000):
    schema = {"name": "chain", "schema": ref_chain(n)}
    try:
        litellm.completion(model="mlx-parallm/fake", messages=[{"role": "user", "content": "Hi"}],
                           response_format={"type": "json_schema", "json_schema": schema})
        print("accepted")
    except litellm.BadRequestError as error:
        print(json.dumps(str(error)))
print("requests", len(engine.calls))
"""


@pytest.mark.early(command=lambda params: _child(DEEP_REFS))
def test_deep_ref_chains_through_litellm_are_a_bad_request_not_a_crash(request: pytest.FixtureRequest) -> None:
    *errors, requests = _lines(request)
    assert len(errors) == 2 and requests == "requests 0"
    assert "max_ref_chain" in json.loads(errors[0])
    assert "GrammarLimits." in json.loads(errors[1])  # the 10,000 one is over more than one


LONG_LARK = """
import json, mlx_parallm_provider
from mlx_parallm_provider.engine import Constraint
from mlx_parallm_provider.errors import InvalidParameterError
from test_grammar_limits import lark_chain
for n in (3_000, 30_000):
    try:
        Constraint.lark(lark_chain(n))
        print("accepted")
    except InvalidParameterError as error:
        print(json.dumps([error.field, str(error)]))
"""


@pytest.mark.early(command=lambda params: _child(LONG_LARK))
def test_long_lark_rule_chains_are_invalid_not_a_crash(request: pytest.FixtureRequest) -> None:
    for line in _lines(request):
        field, message = json.loads(line)
        assert field == "constraint (lark)" and "max_lark_rules" in message


# 127 chained $refs, each through 55 nested objects: within every limit, and deeper than
# an 8 MiB stack holds (it crashed on the caller's thread): the compiler threads take it.
DEEP_WITHIN = """
import threading, types, mlx_parallm_provider
from fakes import make_tokenizer
from mlx_parallm_provider.engine import Constraint
from mlx_parallm_provider.engine.grammar.guided import GrammarTokenizer, RowMatcher
def nest(leaf, k):
    for _ in range(k):
        leaf = {"type": "object", "properties": {"a": leaf}, "required": ["a"]}
    return leaf
defs = {f"d{i}": nest({"$ref": f"#/$defs/d{i + 1}"}, 55) for i in range(127)}
defs["d127"] = {"type": "string"}
constraint = Constraint.json_schema({"$ref": "#/$defs/d0", "$defs": defs})
hf = make_tokenizer()
grammar = GrammarTokenizer(types.SimpleNamespace(_tokenizer=hf), len(hf), [hf.eos_token_id])
box = []
worker = threading.Thread(target=lambda: box.append(RowMatcher(constraint, grammar).matcher.is_error()))
worker.start(); worker.join()
print(box)
"""


@pytest.mark.early(command=lambda params: _child(DEEP_WITHIN))
def test_a_schema_deep_within_the_limits_compiles_and_builds_a_matcher_on_an_ordinary_thread(request: pytest.FixtureRequest) -> None:
    assert _lines(request) == ["[False]"]


SMALL = GrammarLimits(max_bytes=1000, max_depth=8, max_defs=5, max_ref_chain=4, max_lark_rules=4)


@pytest.mark.parametrize(
    ("kind", "value", "limit"),
    [
        ("regex", "a" * 1001, "max_bytes"),
        ("json_schema", json.dumps({"type": "object", "properties": {"a": {"anyOf": [[[[[{}]]]]]}}}), "max_depth"),
        ("json_schema", json.dumps({"$defs": {f"d{i}": {"type": "string"} for i in range(6)}}), "max_defs"),
        ("json_schema", json.dumps(ref_chain(4)), "max_ref_chain"),
        ("lark", lark_chain(5), "max_lark_rules"),
        ("lark", "start: " + "(" * 9 + '"x"' + ")" * 9, "max_depth"),
        ("lark", 'start: "<" %json ' + json.dumps(ref_chain(4)), "max_ref_chain"),
    ],
)
def test_each_limit_is_named_when_exceeded(kind: str, value: str, limit: str) -> None:
    with pytest.raises(InvalidParameterError, match=rf"GrammarLimits\.{limit}\)"):
        check_grammar_input(kind, value, SMALL)
    check_grammar_input(kind, value, dataclasses.replace(SMALL, **{limit: 10**6}))  # that limit, and only it


def test_recursive_and_realistic_schemas_pass_the_checks() -> None:
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    check_grammar_input("json_schema", json.dumps(tree))  # recursion ends a chain; llguidance decides
    nested = {"$ref": "#/$defs/m0", "$defs": {f"m{i}": {"type": "object", "properties": {
        "next": {"$ref": f"#/$defs/m{i + 1}"}, "name": {"type": "string"}}} for i in range(20)}}
    nested["$defs"]["m20"] = {"type": "string"}
    check_grammar_input("json_schema", json.dumps(nested))  # pydantic models 20 deep


def test_equal_constraints_are_compiled_once_and_their_rows_share_one_built_matcher(monkeypatch) -> None:
    compiled, built = [], []
    monkeypatch.setattr(constraint_module, "run_compiler", lambda fn, *a: compiled.append(a) or fn(*a))
    monkeypatch.setattr(guided, "run_compiler", lambda fn, *a: built.append(a) or fn(*a))
    schema = {"type": "object", "properties": {"nonce": {"const": f"{id(compiled)}"}}}  # not cached yet
    first, second = Constraint.json_schema(schema), Constraint.json_schema(dict(schema))
    hf = make_tokenizer()
    grammar = guided.GrammarTokenizer(types.SimpleNamespace(_tokenizer=hf), len(hf), [hf.eos_token_id])
    rows = [guided.RowMatcher(c, grammar) for c in (first, second, first)]
    assert len(compiled) == 1 and len(built) == 1
    rows[0].consume(hf.encode("{", add_special_tokens=False)[0])  # each row has its own state
    assert rows[0].matcher is not rows[1].matcher and not rows[1].matcher.is_stopped()


def test_grammars_compile_on_a_thread_with_a_large_stack() -> None:
    from mlx_parallm_provider.engine.grammar import build_threads as compiler

    names = compiler.run_compiler(lambda: threading.current_thread().name)
    assert names.startswith("mlx-parallm-grammar") and compiler.STACK_BYTES >= 256 << 20


def test_engines_on_one_tokenizer_build_llguidance_s_tokenizer_once() -> None:
    hf, other = make_tokenizer(), make_tokenizer()

    def grammar(tokenizer, vocab_size: int) -> guided.GrammarTokenizer:
        return guided.GrammarTokenizer(types.SimpleNamespace(_tokenizer=tokenizer), vocab_size, [tokenizer.eos_token_id])

    a, b = grammar(hf, len(hf)), grammar(hf, len(hf))
    assert a.get() is b.get() and a.executor is not b.executor  # one table, each worker its own executor
    assert grammar(hf, len(hf) + 32).get() is not a.get()  # another vocabulary
    assert grammar(other, len(other)).get() is not a.get()
