"""Arrival schedules (burst, gamma / Poisson as vLLM's benchmark) and the driver that sends
requests at them under a concurrency cap."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from mlx_parallm_provider.bench.arrivals import arrival_offsets, drive, failure_kind
from mlx_parallm_provider.bench.metrics import RequestRecord, peak_concurrency
from mlx_parallm_provider.bench.workloads import BenchRequest


def test_infinite_rate_is_one_burst() -> None:
    assert arrival_offsets([0, 1, 2], math.inf) == [0.0, 0.0, 0.0]


def test_poisson_offsets_rise_and_end_at_n_over_rate() -> None:
    offsets = arrival_offsets(list(range(50)), request_rate=10.0, seed=3)
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] == pytest.approx(5.0)
    assert offsets == arrival_offsets(list(range(50)), request_rate=10.0, seed=3)
    assert offsets != arrival_offsets(list(range(50)), request_rate=10.0, seed=4)


def test_infinite_burstiness_is_evenly_spaced() -> None:
    assert arrival_offsets([0, 1, 2, 3], request_rate=2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_lower_burstiness_gives_more_irregular_gaps() -> None:
    def cv(burstiness: float) -> float:
        gaps = np.diff([0.0] + arrival_offsets(list(range(4000)), 100.0, burstiness, seed=1))
        return float(gaps.std() / gaps.mean())

    # gamma of shape k has a coefficient of variation of 1/sqrt(k)
    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)


def test_samples_of_one_prompt_arrive_together() -> None:
    offsets = arrival_offsets([0, 0, 1, 1, 2, 2], request_rate=1.0, seed=0)
    assert offsets[0] == offsets[1] and offsets[2] == offsets[3] and offsets[4] == offsets[5]
    assert offsets[5] == pytest.approx(3.0)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)])
def test_bad_rates_are_rejected(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets([0], rate, burstiness)


def test_drive_caps_concurrency_records_failures_and_waits_for_offsets() -> None:
    requests = [BenchRequest([{"role": "user", "content": str(i)}], 4, group=i, prompt_ids=[1] * (i + 1)) for i in range(6)]
    done: list[int] = []

    async def send(request: BenchRequest, record: RequestRecord) -> None:
        await asyncio.sleep(0.02)
        if request.group == 5:
            raise TimeoutError("slow")
        record.add_chunk(3)

    offsets = [0.0] * 5 + [0.1]
    records, duration = asyncio.run(drive(requests, send, offsets, max_concurrency=2, on_done=lambda: done.append(1)))
    assert len(done) == 6 and duration >= 0.1
    assert peak_concurrency(records) <= 2
    assert [r.error for r in records] == [None] * 5 + ["TimeoutError"]
    assert [r.prompt_tokens for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r.output_tokens == 3 and r.ttft is not None and r.ttft >= 0 for r in records[:5])
    assert records[5].start - min(r.start for r in records) >= 0.09


def test_failure_kind_prefers_a_kind_attribute() -> None:
    error = RuntimeError("x")
    assert failure_kind(error) == "RuntimeError"
    error.kind = "http_429"  # type: ignore[attr-defined]
    assert failure_kind(error) == "http_429"
