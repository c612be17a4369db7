"""The rectangle layout's decode batch keeps its rows' KV order; the plan says who decodes."""

from __future__ import annotations

import mlx_parallm_provider  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import pytest

from mlx_parallm_provider.engine.rectangle import RectangleBatch
from mlx_parallm_provider.engine.request import Request, ResultSink, SamplingParams


class _Cache:
    def __init__(self) -> None:
        self.kept: list[list[int]] = []

    def filter(self, rows: list[int]) -> None:
        self.kept.append(rows)


def _echo(tokens: mx.array, cache: object) -> mx.array:
    """Logits whose only column is each row's input token: (B, 1, 1)."""
    return tokens[:, :, None].astype(mx.float32)


def _row(name: str, last: int) -> Request:
    r = Request(name, [1, 2], SamplingParams(max_tokens=4), ResultSink())
    r.output_ids = [last]
    return r


def test_logits_come_back_in_the_order_asked_and_finished_rows_leave() -> None:
    a, b, c = _row("a", 10), _row("b", 20), _row("c", 30)
    batch = RectangleBatch()
    layer = _Cache()
    batch.join([layer], [a, b], None, 1)
    batch.cache = [layer]  # (join extends a real cache; here one fake layer)
    batch.rows.append(c)
    assert batch.decode(_echo, [a, b, c])[:, 0].tolist() == [10, 20, 30]
    assert batch.decode(_echo, [c, a, b])[:, 0].tolist() == [30, 10, 20]
    with pytest.raises(ValueError):
        batch.decode(_echo, [a, b])
    b.finished = True
    batch.evict_finished()
    assert batch.rows == [a, c] and layer.kept == [[0, 2]]
    a.finished = c.finished = True
    batch.evict_finished()
    assert batch.rows == [] and batch.cache is None
