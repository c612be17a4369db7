"""Fuzz constraints (issue 21): any JSON schema, regex or Lark grammar either answers (an
answer that stopped matches it), runs out of ``max_tokens``, or is refused with an
``InvalidParameterError`` on ``constraint``; never another error, a crash or a hang, and the
innocent greedy requests decoding beside it finish exactly as they would alone.

Cheap by design (~30 s of CI): a few dozen examples a test (a third of the profile's), 16
tokens an answer, on the tiny model."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Callable

from hypothesis import event, given, settings
from hypothesis import strategies as st

from fuzzing import HANG_S, INNOCENT, INNOCENT_PROMPTS, engine, expected  # noqa: F401  (fixtures)
from grammars import json_schemas, lark_grammars, regexes
from mlx_parallm_provider.engine import Completion, Constraint, Engine, SamplingParams
from mlx_parallm_provider.errors import InvalidParameterError

try:
    from jsonschema import Draft202012Validator
except ImportError:  # pragma: no cover - json.loads only
    Draft202012Validator = None

EXAMPLES = settings(max_examples=max(10, settings.default.max_examples // 3), deadline=None)


async def _streamed(engine: Engine, params: SamplingParams) -> Completion:
    pieces = [d async for d in engine.stream("x", params)]
    assert sum(len(d.token_ids) for d in pieces) <= params.max_tokens
    return Completion(request_id="streamed", text="".join(d.text for d in pieces),
                      token_ids=[t for d in pieces for t in d.token_ids], finish_reason=pieces[-1].finish_reason, usage=None)


def _answer(engine: Engine, expected: list, make: Callable[[], Constraint], seed: int, stream: bool = False) -> Any:
    """The fuzzed request's Completion (``stream``: its pieces joined), or its
    InvalidParameterError (at construction, at submit or mid-generation); asserts
    everything else an outcome must hold."""
    async def together():
        try:
            constraint = await asyncio.to_thread(make)
        except InvalidParameterError as error:
            return error, None
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, constraint=constraint)
        fuzzed = _streamed(engine, params) if stream else engine.generate("x", params)
        return await asyncio.gather(fuzzed, *(engine.generate(p, INNOCENT) for p in INNOCENT_PROMPTS),
                                    return_exceptions=True), constraint

    async def bounded():
        return await asyncio.wait_for(together(), HANG_S)

    results, constraint = asyncio.run(bounded())
    if constraint is None:
        event(f"refused when built: {str(results).partition(': ')[2][:40]}")
        return results
    fuzzed, *innocent = results
    assert [getattr(r, "token_ids", r) for r in innocent] == expected
    assert engine._core.alive, f"the worker died: {engine._core.dead!r}"
    if isinstance(fuzzed, BaseException):
        assert isinstance(fuzzed, InvalidParameterError), f"untyped error {type(fuzzed).__name__}: {fuzzed}"
        assert fuzzed.field == "constraint" and "\n" not in str(fuzzed), fuzzed
        after = "after some output" if "fails after" in str(fuzzed) else "before any output"
        event(f"refused {after}: {str(fuzzed).partition('(')[2][:40]}")
        return fuzzed
    assert isinstance(fuzzed, Completion) and fuzzed.finish_reason in ("stop", "length"), fuzzed
    event(f"answered: {fuzzed.finish_reason}")
    return fuzzed


@EXAMPLES
@given(schema=json_schemas, seed=st.integers(0, 2**16))
def test_any_json_schema_answers_valid_or_is_refused_typed(engine, expected, schema, seed) -> None:
    answer = _answer(engine, expected, lambda: Constraint.json_schema(schema), seed)
    if isinstance(answer, Completion) and answer.finish_reason == "stop":
        value = json.loads(answer.text)
        if Draft202012Validator is not None:
            errors = [e.message for e in Draft202012Validator(schema).iter_errors(value)]
            assert not errors, f"{answer.text!r} does not match {schema}: {errors}"


@EXAMPLES
@given(pattern=regexes, seed=st.integers(0, 2**16))
def test_any_regex_answers_a_match_or_is_refused_typed(engine, expected, pattern, seed) -> None:
    answer = _answer(engine, expected, lambda: Constraint.regex(pattern), seed)
    if isinstance(answer, Completion) and answer.finish_reason == "stop":
        try:
            compiled = re.compile(pattern)
        except re.error:
            return  # llguidance's dialect only: nothing to check it with
        assert compiled.fullmatch(answer.text), f"{answer.text!r} does not match {pattern!r}"


@EXAMPLES
@given(grammar=lark_grammars, seed=st.integers(0, 2**16), stream=st.booleans())
def test_any_lark_grammar_answers_or_is_refused_typed(engine, expected, grammar, seed, stream) -> None:
    _answer(engine, expected, lambda: Constraint.lark(grammar), seed, stream)
