"""A step's logit biases and penalties, applied to all its rows at once, give each row the
logits mlx-lm's own processors give it alone (the same arithmetic, bit for bit), the penalties
over its last tokens only. No CPU kernel: scripts/gpu_check.sh runs these on a GPU."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlx_parallm_provider.engine import logits_processors
from mlx_parallm_provider.engine.logits_processors import HISTORY_TOKENS, PENALTY_CONTEXT, last_tokens
from mlx_parallm_provider.engine.request import SamplingParams
from mlx_parallm_provider.engine.sampling import RowSampler, sample_batch

pytestmark = pytest.mark.gpu

ROWS = [  # (logits processors, tokens so far)
    ({}, [5, 6, 7]),
    ({"logit_bias": {0: 2.5, 17: -100.0, 90: 0.75}}, [1, 2]),
    ({"logit_bias": {3: 1.0}, "repetition_penalty": 1.4}, [3, 3, 4]),
    ({"repetition_penalty": 1.3}, [3, 3, 9, 1, 3]),
    ({"presence_penalty": 0.5}, list(range(40, 90))),  # (only the last 20 count)
    ({"frequency_penalty": 0.7, "repetition_penalty": 0.8}, [2, 2, 2, 4, 4, 11]),
    ({"repetition_penalty": 1.1, "presence_penalty": -0.4, "frequency_penalty": 1.9}, [0, 1, 0, 1, 0, 63] * 5),
    ({"frequency_penalty": -2.0}, [8]),
    ({"presence_penalty": 2.0}, []),  # (no tokens yet: nothing to penalise)
]


def _processors(params: SamplingParams) -> list:
    """mlx-lm's logits processors for ``params`` (logit bias, then the penalties), counting
    the last :data:`PENALTY_CONTEXT` tokens."""
    return make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT,
    )


def _alone(logits: mx.array, sampler: RowSampler, tokens: list[int]) -> mx.array:
    """The row through mlx-lm's processors, given its whole history as they take it."""
    for n, processor in enumerate(_processors(sampler.params)):
        if tokens or (n == 0 and sampler.bias):  # (the bias needs no history; the penalties skip an empty one)
            logits = processor(mx.array(tokens), logits)
    return logits


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_batched_processors_are_mlx_lms_row_by_row(dtype) -> None:
    logits = (mx.random.normal((len(ROWS), 128), key=mx.random.key(3)) * 4).astype(dtype)
    samplers = [RowSampler(SamplingParams(**p)) for p, _ in ROWS]
    contexts = [lambda t=t: t for _, t in ROWS]
    got = logits_processors.processed(logits, samplers, contexts)
    assert got.dtype == dtype
    want = mx.concatenate([_alone(logits[i : i + 1], s, t) for i, (s, (_, t)) in enumerate(zip(samplers, ROWS))])
    assert mx.array_equal(got, want).item()
    assert not mx.array_equal(got, logits).item()  # (they did penalise)
    assert mx.array_equal(got[0], logits[0]).item() and mx.array_equal(got[-1], logits[-1]).item()


def test_rows_sample_as_alone_with_penalties_beside_them() -> None:
    """A seeded row draws the same tokens alone and beside penalised rows, and a penalised
    row the same as the row-by-row processors make it draw."""
    logits = mx.random.normal((len(ROWS), 300), key=mx.random.key(4)) * 3
    contexts = [lambda t=t: t for _, t in ROWS]
    params = [SamplingParams(temperature=0.8, seed=i, logprobs=True, top_logprobs=3, **p) for i, (p, _) in enumerate(ROWS)]
    together = sample_batch(logits, [RowSampler(p) for p in params], contexts)
    alone = [sample_batch(logits[i : i + 1], [RowSampler(p)], contexts[i : i + 1])[0] for i, p in enumerate(params)]
    assert [(r.token, r.logprob, r.top) for r in together] == [(r.token, r.logprob, r.top) for r in alone]


def test_a_token_outside_the_logits_fails_its_row_alone() -> None:
    logits = mx.random.normal((3, 50), key=mx.random.key(5))
    samplers = [RowSampler(SamplingParams(temperature=0.0, repetition_penalty=1.2)) for _ in range(3)]
    got = sample_batch(logits, samplers, [lambda: [1, 2], lambda: [3, 50], lambda: [4]])
    assert isinstance(got[1].error, ValueError) and "outside" in str(got[1].error)
    assert got[0].error is None and got[2].error is None
    assert [got[0].token, got[2].token] == [sample_batch(logits[i : i + 1], samplers[i : i + 1], [c])[0].token
                                           for i, c in ((0, lambda: [1, 2]), (2, lambda: [4]))]


def test_last_tokens() -> None:  # (the last HISTORY_TOKENS = 32: penalties count the last 20 of them)
    assert last_tokens([1, 2, 3], [4]) == [1, 2, 3, 4]
    assert last_tokens(list(range(50)), [99, 98]) == list(range(20, 50)) + [99, 98]
    assert last_tokens([1], list(range(40))) == list(range(8, 40))
    assert last_tokens(list(range(10)), list(range(10, 40)), [7]) == list(range(9, 40)) + [7]
    assert last_tokens([], []) == []
    assert len(last_tokens(list(range(100)))) == HISTORY_TOKENS > PENALTY_CONTEXT
