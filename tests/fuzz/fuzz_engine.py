"""Fuzz the engine's front: any SamplingParams and prompt either answers or raises a typed
package error, and innocent requests running beside it finish exactly as they would alone."""

from __future__ import annotations

import asyncio

from hypothesis import event, given
from hypothesis import strategies as st

from fuzzing import INNOCENT, INNOCENT_PROMPTS, engine, expected, hostile_kwargs, plausible_kwargs, prompts, run  # noqa: F401  (fixtures)
from mlx_parallm_provider.engine import Completion, Engine, SamplingParams
from mlx_parallm_provider.errors import InvalidParameterError, MLXParallmError


async def _fuzzed(engine: Engine, prompt, params: SamplingParams, stream: bool):
    if not stream:
        return await engine.generate(prompt, params)
    pieces = [d async for d in engine.stream(prompt, params)]
    return pieces


@given(kwargs=hostile_kwargs)
def test_sampling_params_are_valid_or_refused_with_the_field_named(kwargs) -> None:
    try:
        SamplingParams(**kwargs)
    except InvalidParameterError as error:
        assert error.field.split("[")[0] in kwargs, error


@given(kwargs=plausible_kwargs, prompt=prompts, stream=st.booleans())
def test_any_request_answers_or_fails_typed_and_harms_no_neighbour(engine, expected, kwargs, prompt, stream) -> None:
    # 24 tokens unless drawn (the default 256 on the tiny model, which seldom ends a row, was
    # most of this test's time), as the LiteLLM and LangChain fuzz modules cap theirs.
    kwargs = {"max_tokens": 24, **kwargs}
    try:
        params = SamplingParams(**kwargs)
    except InvalidParameterError:
        event("refused by SamplingParams")
        return  # refused at construction, with the package's error: nothing reached the engine

    async def together():
        return await asyncio.gather(
            _fuzzed(engine, prompt, params, stream),
            *(engine.generate(p, INNOCENT) for p in INNOCENT_PROMPTS),
            return_exceptions=True,
        )

    fuzzed, *innocent = run(together())
    event(f"engine: {type(fuzzed).__name__}")
    if isinstance(fuzzed, BaseException):
        assert isinstance(fuzzed, MLXParallmError), f"untyped error {type(fuzzed).__name__}: {fuzzed}"
    elif stream:
        assert fuzzed and fuzzed[-1].finish_reason in ("stop", "length")
        assert sum(len(d.token_ids) for d in fuzzed) <= params.max_tokens
    else:
        assert isinstance(fuzzed, Completion) and fuzzed.finish_reason in ("stop", "length")
        assert len(fuzzed.token_ids) <= params.max_tokens
    assert [getattr(r, "token_ids", r) for r in innocent] == expected
    assert engine._core.alive, f"the worker died: {engine._core.dead!r}"
