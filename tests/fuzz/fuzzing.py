"""Shared pieces of the fuzz suite: strategies of hostile input and the engine fixtures of
the engine-level modules (Hypothesis's ``ci`` and ``long`` profiles are registered by
``tests/conftest.py``, before pytest reads ``--hypothesis-profile``).

The fuzz modules (``fuzz_*.py``) are not collected by the normal test run. The test
``tests/integration/test_fuzz.py`` runs them in a subprocess, so a crash of the process
is a test failure rather than a lost CI run. Run them by hand, longer:

    .venv/bin/python -m pytest tests/fuzz -o python_files='fuzz_*.py' --hypothesis-profile=long
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import strategies as st

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams

HANG_S = 60.0  # a call that takes longer than this counts as a hang

# Greedy requests decoding beside each fuzzed one: they must answer as they do alone.
INNOCENT = SamplingParams(max_tokens=6, ignore_eos=True)
INNOCENT_PROMPTS = ["the quick brown fox", "seven curious cats"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The engine-level fuzz modules' engine on the tiny model (a queue deep enough for
    every example's requests); a module imports it from here."""
    engine = Engine("tiny", EngineConfig(max_queue=64), loaded=tiny_model)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(engine):
    """What the innocent requests answer alone."""
    return [engine.generate_sync(p, INNOCENT).token_ids for p in INNOCENT_PROMPTS]

# Values of the wrong kind, for any field.
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(min_value=-3, max_value=10**8), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


token_ids = st.integers(min_value=-2, max_value=60_000) | st.sampled_from([49151, 49152, 10**7, 2**63])



def mostly(valid: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` four times in five, else ``other`` (a weighted choice: ``one_of`` would
    flatten nested alternatives and weigh each branch of ``other`` like ``valid``)."""
    return st.integers(0, 4).flatmap(lambda i: other if i == 4 else valid)


valid_token = st.integers(min_value=0, max_value=49151)
# Values of the right kind: mostly valid, some near and past the edges of each range.
PLAUSIBLE = {
    "max_tokens": mostly(st.integers(1, 24), st.sampled_from([-1, 0, 10**9])),
    "temperature": mostly(st.just(0.0) | st.floats(0.0, 3.0), st.sampled_from([-0.5, float("inf"), float("nan")])),
    "top_p": mostly(st.floats(0.01, 1.0), st.sampled_from([0.0, -0.1, 1.1])),
    "top_k": mostly(st.integers(0, 100) | st.sampled_from([49151, 49152]), st.sampled_from([-1, 49153, 10**6])),
    "min_p": mostly(st.floats(0.0, 1.0), st.sampled_from([-0.1, 1.1])),
    "repetition_penalty": mostly(st.floats(0.05, 3.0), st.sampled_from([0.0, -0.5])),
    "presence_penalty": mostly(st.floats(-2.0, 2.0), st.sampled_from([-2.5, 2.5])),
    "frequency_penalty": mostly(st.floats(-2.0, 2.0), st.sampled_from([-2.5, 2.5])),
    "logit_bias": mostly(
        st.dictionaries(valid_token | valid_token.map(str), st.floats(-100, 100), max_size=3),
        st.dictionaries(token_ids | token_ids.map(str), st.floats(-150, 150), min_size=1, max_size=3),
    ),
    "stop": mostly(st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
                    st.sampled_from(["", [""], [5]])),
    "stop_token_ids": mostly(st.lists(valid_token, max_size=3), st.lists(token_ids, min_size=1, max_size=3)),
    "ignore_eos": st.booleans(),
    "seed": mostly(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64, 2**65])),
    "logprobs": st.booleans(),
    "top_logprobs": mostly(st.integers(0, 20), st.sampled_from([-1, 21, 25])),
    "timeout": mostly(st.none() | st.floats(0.001, 5.0), st.sampled_from([-1.0, 0.0])),
    "min_tokens": mostly(st.integers(0, 24), st.sampled_from([-1, 10**9])),
    "allowed_token_ids": mostly(st.none() | st.lists(valid_token, min_size=1, max_size=5), st.sampled_from([[], [-1], [49152], [2**63]])),
    "bad_words": mostly(st.lists(st.text(min_size=1, max_size=6), max_size=3), st.sampled_from([[""], ["   "], [5], ["word " * 40]])),
    "skip_special_tokens": st.booleans(),
    "truncate_prompt_tokens": mostly(st.none() | st.integers(1, 600) | st.just(-1), st.sampled_from([0, -2, 10**9])),
    "prompt_logprobs": mostly(st.none() | st.integers(0, 20), st.sampled_from([-1, 21, 10**6])),
    "prediction": mostly(st.none() | st.text(max_size=30), st.sampled_from([5, {"type": "audio"}, {"type": "content", "content": [1]}])),
}

plausible_kwargs = st.sets(st.sampled_from(sorted(PLAUSIBLE)), max_size=5).flatmap(
    lambda names: st.fixed_dictionaries({name: PLAUSIBLE[name] for name in names})
)
"""SamplingParams keyword arguments of the right kinds: many are valid, reaching the engine."""

hostile_kwargs = st.fixed_dictionaries({}, optional={name: s | junk for name, s in PLAUSIBLE.items()})
"""The same with values of any kind mixed in."""

prompts = st.one_of(
    st.text(max_size=40),
    st.lists(token_ids, max_size=12),
    st.sampled_from(["<|im_start|>user\nhi<|im_end|>", "\x00\ud7ff\U0001f600", "a" * 300]),
)


def run(coro: Any, timeout: float = HANG_S) -> Any:
    """Run a coroutine on a fresh loop; longer than ``timeout`` is a hang (TimeoutError)."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())
