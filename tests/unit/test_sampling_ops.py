"""The CPU kernels' sampled-row ops (``kernels/sampling.cpp``): the log-softmax gives MLX's
logprobs bit for bit, the Gumbel-max draw gives the tokens MLX's own draw gives (the same noise
bits, the same ties), the filters keep the tokens mlx-lm's top-p, min-p and top-k keep; the
engine's sampled rows go through them."""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_p
from test_batched_draws import FILTERS, mlx_lm_filters

from mlx_parallm_provider.engine.request import SamplingParams
from mlx_parallm_provider.engine.sampling import RowSampler, draw_tokens
from mlx_parallm_provider.models import qmatmul_ext
from mlx_parallm_provider.models.backends import CPUKernels

ext = qmatmul_ext.load()
pytestmark = pytest.mark.skipif(not hasattr(ext, "filter_rows"), reason="the MLX extension does not build here")

mlx_draw = mx.vmap(lambda row, key: mx.argmax(row + mx.random.gumbel(row.shape, key=key)))


@pytest.mark.parametrize("vocab", [1, 2, 31, 32, 33, 1001, 49152])
@pytest.mark.parametrize("threads", [1, 3])
def test_it_draws_what_mlx_draws(vocab: int, threads: int) -> None:
    """Even and odd vocabularies (MLX lays a key's words out by halves, the middle one last
    for odd widths), tails shorter than the 16 lanes, more threads than rows or fewer."""
    for seed in range(3):
        rows = mx.random.normal((5, vocab), key=mx.random.key(seed)) * (4.0 if seed else 0.2)
        keys = mx.random.split(mx.random.key(100 + seed), 5)
        assert ext.gumbel_draw(rows, keys, threads).tolist() == mlx_draw(rows, keys).tolist()


def test_ties_infinities_and_nans_as_mlx_takes_them() -> None:
    keys = mx.random.split(mx.random.key(7), 3)
    inf, nan = float("inf"), float("nan")
    for vocab in (1, 5, 40):
        nans = mx.random.normal((3, vocab), key=mx.random.key(vocab))
        nans[1, vocab // 2] = nan
        nans[2, vocab - 1] = nan
        nans[2, 0] = nan
        one = mx.full((3, vocab), -inf)
        one[:, vocab - 1] = 0.0
        for rows in (mx.full((3, vocab), -inf), mx.zeros((3, vocab)), mx.full((3, vocab), 1e30), nans, one):
            assert ext.gumbel_draw(rows, keys).tolist() == mlx_draw(rows, keys).tolist()


def test_it_refuses_what_it_does_not_take() -> None:
    keys = mx.random.split(mx.random.key(0), 2)
    with pytest.raises(ValueError, match="float32"):
        ext.gumbel_draw(mx.zeros((2, 8), dtype=mx.bfloat16), keys)
    with pytest.raises(ValueError, match="uint32"):
        ext.gumbel_draw(mx.zeros((2, 8)), keys[:1])
    with pytest.raises(ValueError, match="params"):
        ext.filter_rows(mx.zeros((2, 8)), mx.zeros((3, 3)))
    backend = CPUKernels()
    assert backend.gumbel_draw(mx.zeros((2, 8), dtype=mx.bfloat16), keys) is None  # (the engine draws with MLX's ops)
    assert backend.gumbel_draw(mx.zeros((2, 8)), keys) is not None
    assert backend.filter_rows(mx.zeros((2, 8), dtype=mx.bfloat16), [0.9] * 2, [0.0] * 2, [0] * 2) is None


mlx_log_softmax = pytest.mark.skipif(sys.platform == "darwin", reason="MLX's CPU adds a row's exps 8 at a time on macOS")


@mlx_log_softmax
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1001, 49152])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_log_softmax_is_mlxs(vocab: int, threads: int) -> None:
    """Rows of every width against 16 lanes, shifted and spread so that exp meets its whole
    range (underflow below -88 included), 1 to 17 rows (eight at a time, and the rest): the
    logprobs MLX's ``x - logsumexp(x)`` gives, bit for bit."""
    for seed, (rows, spread, shift) in enumerate([(1, 1.0, 0.0), (5, 0.01, 100.0), (9, 30.0, -50.0), (17, 300.0, 7.0), (3, 3.0, 1e6)]):
        x = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * spread + shift
        want = x - mx.logsumexp(x, axis=-1, keepdims=True)
        assert mx.array_equal(ext.log_softmax(x, threads), want).item(), (rows, spread, shift)


@mlx_log_softmax
def test_the_log_softmax_takes_infinities_and_nans_as_mlx_does() -> None:
    inf, nan = math.inf, math.nan
    rows = mx.array([[-inf] * 5, [inf, 0, 1, 2, 3], [nan, 1, 2, 3, 4], [0, -inf, 3, -inf, 1], [1e30, -1e30, 0, 0, 0], [88.5, 0, -88.5, -100, 3]])
    want = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    assert mx.array_equal(ext.log_softmax(rows), want, equal_nan=True).item()
    backend = CPUKernels()
    assert backend.log_softmax(rows.astype(mx.bfloat16)) is None  # (the engine normalises with MLX's ops)
    assert mx.array_equal(backend.log_softmax(rows), want, equal_nan=True).item()
    with pytest.raises(ValueError, match="float32"):
        ext.log_softmax(mx.zeros((2, 8), dtype=mx.float16))


@pytest.mark.parametrize("vocab", [1, 5, 20, 1001, 49152])
def test_the_top_tokens_are_the_rows_largest(vocab: int) -> None:
    """Each row's k largest values, largest first, ties to the lower index, NaN last: a
    sort's answer (and the values MLX's argpartition picks)."""
    rows = mx.random.normal((6, vocab), key=mx.random.key(vocab)) * 3
    rows = mx.where(mx.arange(vocab)[None] % 7 == 3, -math.inf, rows)
    rows[1] = mx.round(rows[1])  # (many ties)
    rows[2, vocab // 2] = math.nan
    rows[2, :3] = math.nan  # (the worst kept is NaN until numbers come)
    rows[3] = 0.0
    orders = [sorted(range(vocab), key=lambda i: (math.isnan(row[i]), -row[i] if not math.isnan(row[i]) else 0, i))
              for row in rows.tolist()]
    for k in sorted({1, min(5, vocab), min(20, vocab), vocab}):
        got = CPUKernels().top_tokens(rows, k)
        for n, row in enumerate(rows.tolist()):
            assert got[n].tolist() == orders[n][:k], (n, k)
            if n != 2:
                want = mx.sort(mx.take(mx.array(row), mx.argpartition(-mx.array(row), kth=k - 1)[:k]))
                assert mx.array_equal(mx.sort(mx.take(mx.array(row), got[n])), want).item()
    assert CPUKernels().top_tokens(rows, vocab + 1) is None  # (MLX's argpartition refuses it, as before)
    with pytest.raises(ValueError, match="k must"):
        ext.top_tokens(rows, 0)


@pytest.mark.parametrize("vocab", [7, 100, 4096, 49152])
def test_the_filters_keep_what_mlx_lms_keep(vocab: int) -> None:
    """Flat and peaked rows (the nucleus from a few tokens to most of the vocabulary), the
    kept tokens' logprobs unchanged: the same rows as mlx-lm's functions give, bit for bit."""
    backend = CPUKernels()
    for seed in range(3):
        for spread in (0.5, 3.0, 12.0):
            x = mx.random.normal((len(FILTERS), vocab), key=mx.random.key(seed)) * spread
            logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
            got = backend.filter_rows(logprobs, *map(list, zip(*FILTERS)))
            for n, settings in enumerate(FILTERS):
                assert mx.array_equal(got[n : n + 1], mlx_lm_filters(logprobs[n : n + 1], *settings)).item(), (seed, spread, settings)


@pytest.mark.parametrize("shift", [-6.0, -0.3, 2.0])
def test_top_p_keeps_mlx_lms_tokens_of_rows_that_do_not_sum_to_one(shift: float) -> None:
    """Logprobs shifted (their masses summing to ~0.0025, ~0.74, ~7.4): the tokens that can
    move the sum are chosen by the largest alone where the sum stays below 1/2."""
    backend = CPUKernels()
    x = mx.random.normal((4, 49152), key=mx.random.key(9)) * mx.array([[0.5], [3.0], [8.0], [20.0]])
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True) + shift
    for top_p in (0.5, 0.9, 0.999999):
        got = backend.filter_rows(logprobs, [top_p] * 4, [0.0] * 4, [0] * 4)
        for n in range(4):
            assert mx.array_equal(got[n : n + 1], apply_top_p(logprobs[n : n + 1], top_p)).item(), (top_p, n)


def test_the_filters_take_rows_that_are_partly_minus_infinity() -> None:
    """Rows a grammar or a logit bias masked: -inf logprobs stay out, every setting."""
    backend = CPUKernels()
    x = mx.random.normal((len(FILTERS), 300), key=mx.random.key(5)) * 3
    x = mx.where(mx.arange(300)[None] % 3 == 0, -math.inf, x)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    got = backend.filter_rows(logprobs, *map(list, zip(*FILTERS)))
    for n, settings in enumerate(FILTERS):
        assert mx.array_equal(got[n : n + 1], mlx_lm_filters(logprobs[n : n + 1], *settings)).item(), settings


def test_samplers_with_the_backends_ops_sample_as_mlx_does() -> None:
    """Batched rows (plain, filtering, greedy) through the backend's filters and draw: the
    tokens mlx-lm's filters and MLX's ops give, step after step, and what each row draws alone."""
    calls = []

    class Counted(CPUKernels):
        def gumbel_draw(self, rows: mx.array, keys: mx.array):
            calls.append(("draw", rows.shape[0]))
            return super().gumbel_draw(rows, keys)

        def filter_rows(self, logprobs, top_p, min_p, top_k):
            calls.append(("filter", logprobs.shape[0]))
            return super().filter_rows(logprobs, top_p, min_p, top_k)

        def log_softmax(self, rows):
            calls.append(("normalise", rows.shape[0]))
            return super().log_softmax(rows)

    backend = Counted()

    settings = [dict(temperature=0.7, seed=1), dict(temperature=0.0), dict(temperature=1.2, seed=3, top_p=0.9),
                dict(temperature=1.0, seed=4, top_k=7), dict(temperature=0.5, seed=5)]
    logits = mx.random.normal((len(settings), 3001), key=mx.random.key(1)) * 3
    kernel = [RowSampler(SamplingParams(**s), ops=backend) for s in settings]
    plain = [RowSampler(SamplingParams(**s)) for s in settings]
    alone = [RowSampler(SamplingParams(**s), ops=backend) for s in settings]
    for _ in range(5):
        got = draw_tokens(logits, kernel).tolist()
        assert got == draw_tokens(logits, plain).tolist()
        assert got == [draw_tokens(logits[i : i + 1], [s]).item() for i, s in enumerate(alone)]
    # the filtering rows normalised and filtered, the drawing rows (not the greedy one) drawn
    assert calls[:3] == [("normalise", 2), ("filter", 2), ("draw", len(settings) - 1)]


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9, "top_k": 30}, {"top_p": 0.8, "logprobs": True, "top_logprobs": 3}],
                         ids=["plain", "top-p-top-k", "top-p-logprobs"])
def test_the_engine_samples_through_its_backend(make_engine, monkeypatch: pytest.MonkeyPatch, filters: dict) -> None:
    """A seeded sampled request answers the same (tokens and logprobs) whether the CPU kernels
    normalise, filter and draw or MLX's ops and mlx-lm's filters do, and the kernels did."""
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, **filters)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    used = []
    ops = ("gumbel_draw", "filter_rows", "log_softmax", "top_tokens")

    def counted(name):
        method = getattr(CPUKernels, name)

        def call(self, *args):
            used.append(name)
            return method(self, *args)
        return call

    def answers():
        out = make_engine().generate_many_sync(prompts, params)
        return [(c.token_ids, [(t.logprob, t.top_logprobs) for t in c.logprobs or []]) for c in out]

    for name in ops:
        monkeypatch.setattr(CPUKernels, name, counted(name))
    with_kernels = answers()
    filtering = "top_p" in filters
    ranking = bool(filters.get("top_logprobs"))
    assert set(used) == {"gumbel_draw", *(["filter_rows"] if filtering else []), *(["log_softmax"] if filtering or filters.get("logprobs") else []),
                         *(["top_tokens"] if ranking else [])}
    assert bool(with_kernels[0][1]) == bool(filters.get("logprobs"))
    for name in ops:
        monkeypatch.setattr(CPUKernels, name, lambda self, *args: None)
    assert answers() == with_kernels
