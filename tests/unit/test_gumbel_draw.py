"""The CPU kernels' Gumbel-max draw (``kernels/gumbel_draw.cpp``) gives the tokens MLX's own
draw gives: the same noise bits, the same ties; the engine's sampled rows go through it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_parallm_provider.engine.request import SamplingParams
from mlx_parallm_provider.engine.sampling import RowSampler, draw_tokens
from mlx_parallm_provider.models import qmatmul_ext
from mlx_parallm_provider.models.backends import CPUKernels

ext = qmatmul_ext.load()
pytestmark = pytest.mark.skipif(not hasattr(ext, "gumbel_draw"), reason="the MLX extension does not build here")

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
    backend = CPUKernels()
    assert backend.gumbel_draw(mx.zeros((2, 8), dtype=mx.bfloat16), keys) is None  # (the engine draws with MLX's ops)
    assert backend.gumbel_draw(mx.zeros((2, 8)), keys) is not None


def test_samplers_with_the_backends_draw_sample_as_mlx_does() -> None:
    """Batched rows (plain, filtering, greedy) through the backend's draw: the tokens MLX's ops
    draw, step after step, and what each row draws alone."""
    backend = CPUKernels()
    calls = []

    def draw(rows: mx.array, keys: mx.array):
        calls.append(rows.shape[0])
        return backend.gumbel_draw(rows, keys)

    settings = [dict(temperature=0.7, seed=1), dict(temperature=0.0), dict(temperature=1.2, seed=3, top_p=0.9),
                dict(temperature=1.0, seed=4, top_k=7), dict(temperature=0.5, seed=5)]
    logits = mx.random.normal((len(settings), 3001), key=mx.random.key(1)) * 3
    kernel = [RowSampler(SamplingParams(**s), draw=draw) for s in settings]
    plain = [RowSampler(SamplingParams(**s)) for s in settings]
    alone = [RowSampler(SamplingParams(**s), draw=draw) for s in settings]
    for _ in range(5):
        got = draw_tokens(logits, kernel).tolist()
        assert got == draw_tokens(logits, plain).tolist()
        assert got == [draw_tokens(logits[i : i + 1], [s]).item() for i, s in enumerate(alone)]
    assert calls and calls[0] == len(settings) - 1  # the drawing rows went through it, the greedy one not


def test_the_engine_draws_through_its_backend(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded sampled request answers the same whether the CPU kernels draw or MLX's ops do,
    and the kernels did draw."""
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    used = []
    draw = CPUKernels.gumbel_draw

    def counted(self, rows, keys):
        used.append(rows.shape[0])
        return draw(self, rows, keys)

    monkeypatch.setattr(CPUKernels, "gumbel_draw", counted)
    with_kernel = [c.token_ids for c in make_engine().generate_many_sync(prompts, params)]
    assert used
    monkeypatch.setattr(CPUKernels, "gumbel_draw", lambda self, rows, keys: None)
    with_mlx = [c.token_ids for c in make_engine().generate_many_sync(prompts, params)]
    assert with_kernel == with_mlx
