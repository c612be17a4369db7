"""Sampling rows draw together (one key split and one draw op for the batch) and each gets
what it draws alone; the draws follow the softmax of logprobs / temperature; their filters,
without the backend's op, are one batch of MLX ops that gives each row what mlx-lm's
functions give it alone. No CPU kernel: scripts/gpu_check.sh runs these on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_parallm_provider.engine.request import SamplingParams
from mlx_parallm_provider.engine.sampling import RowSampler, draw_tokens, filter_rows

pytestmark = pytest.mark.gpu

ROWS = [dict(temperature=0.7, seed=1), dict(temperature=0.0, seed=2), dict(temperature=1.3, seed=3),
        dict(temperature=0.9, seed=4, top_k=5), dict(temperature=1.0, seed=5, top_p=0.8), dict(temperature=2.0, seed=6)]


@pytest.mark.parametrize("rows", [ROWS, [r for r in ROWS if "top_k" not in r and "top_p" not in r]], ids=["filters", "plain"])
def test_a_batch_draws_what_each_row_draws_alone(rows) -> None:
    logits = mx.random.normal((len(rows), 64), key=mx.random.key(0)) * 3
    together = [RowSampler(SamplingParams(**r)) for r in rows]
    alone = [RowSampler(SamplingParams(**r)) for r in rows]
    for _ in range(6):
        batch = draw_tokens(logits, together).tolist()
        single = [draw_tokens(logits[i : i + 1], [s]).tolist()[0] for i, s in enumerate(alone)]
        assert batch == single
    assert batch[1] == mx.argmax(logits[1]).item()  # the greedy row
    assert len({tuple(draw_tokens(logits, together).tolist()) for _ in range(4)}) > 1  # keys move on: draws vary


def test_draws_follow_the_tempered_softmax_and_respect_top_k() -> None:
    logits = mx.array([[2.0, 1.0, 0.0, -1.0, -3.0]])
    T, n = 0.8, 3000
    sampler = RowSampler(SamplingParams(temperature=T, seed=7))
    counts = np.bincount([draw_tokens(logits, [sampler]).item() for _ in range(n)], minlength=5)
    expected = np.exp(np.array(logits[0].tolist()) / T)
    expected /= expected.sum()
    assert np.abs(counts / n - expected).max() < 0.03  # ~4 standard errors at n = 3,000
    top2 = RowSampler(SamplingParams(temperature=T, seed=8, top_k=2))
    assert {draw_tokens(logits, [top2]).item() for _ in range(200)} == {0, 1}


def test_a_plain_row_draws_alike_beside_rows_that_want_logprobs_or_filter() -> None:
    """Plain rows draw from the logits themselves (no normalisation pass); a row beside one
    that wants logprobs or filters (so the batch is normalised) still draws what it draws alone."""
    from mlx_parallm_provider.engine.sampling import sample_batch

    # bfloat16, as a 16-bit model's: normalised or not, its values round apart by ~1/16, enough
    # to move some draws; not normalised, far from logprobs.
    logits = (mx.random.normal((3, 4096), key=mx.random.key(3)) * 4 + 7).astype(mx.bfloat16)
    for seed in range(40):
        plain = dict(temperature=0.9, seed=seed)
        together = [RowSampler(SamplingParams(**plain)), RowSampler(SamplingParams(temperature=0.9, seed=99, logprobs=True)),
                    RowSampler(SamplingParams(temperature=0.9, seed=98, top_p=0.9))]
        rows = sample_batch(logits, together, [None] * 3)
        alone = draw_tokens(logits[:1], [RowSampler(SamplingParams(**plain))]).item()
        assert rows[0].token == alone and rows[0].error is None
        assert rows[1].logprob is not None and rows[1].logprob <= 0.0  # (its logprob, normalised)
    greedy = sample_batch(logits, [RowSampler(SamplingParams(temperature=0.0)), *together[1:]], [None] * 3)
    assert greedy[0].token == mx.argmax(logits[0]).item()


FILTERS = [(0.9, 0.0, 0), (0.5, 0.0, 0), (0.99, 0.0, 0), (0.999999, 0.0, 0), (0.1, 0.0, 0), (1.0, 0.05, 0), (1.0, 0.2, 0),
           (1.0, 0.0, 40), (1.0, 0.0, 1), (0.8, 0.05, 20), (0.95, 0.0, 5), (1.0, 0.0, 0)]
"""(top_p, min_p, top_k): each alone, together, and none."""


def mlx_lm_filters(logprobs: mx.array, top_p: float, min_p: float, top_k: int) -> mx.array:
    if 0.0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p > 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mlx_ops_filter_a_batch_asmlx_lm_filters_each_row(dtype) -> None:
    """Without the backend's op (a GPU): every setting in one batch of MLX ops, each row what
    mlx-lm's functions give it alone, bit for bit."""
    params = [SamplingParams(temperature=1.0, top_p=p, min_p=m, top_k=k) for p, m, k in FILTERS]
    for seed, spread in enumerate((0.5, 3.0, 12.0)):
        x = (mx.random.normal((len(FILTERS), 3001), key=mx.random.key(seed)) * spread).astype(dtype)
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        got = filter_rows(logprobs, params)
        assert got.dtype == dtype
        for n, settings in enumerate(FILTERS):
            assert mx.array_equal(got[n : n + 1], mlx_lm_filters(logprobs[n : n + 1], *settings)).item(), (spread, settings)
        for n in (1, 6, 7):  # (one setting alone, in a batch of one)
            assert mx.array_equal(filter_rows(logprobs[n : n + 1], params[n : n + 1]), got[n : n + 1]).item()
