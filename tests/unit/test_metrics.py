"""Tests for engine metrics (fake clock, no sleeping)."""

from __future__ import annotations

import json
import threading

import pytest

from mlx_parallm_provider.engine.metrics import LATENCY_BUCKETS, EngineMetrics, percentile, summarize


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(clock: FakeClock) -> EngineMetrics:
    return EngineMetrics(clock=clock)


def test_percentiles_on_known_samples() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert summarize([5.0, 1.0, 3.0]) == {"p50": 3.0, "p99": pytest.approx(4.96)}
    assert summarize([]) == {"p50": None, "p99": None}


def test_request_lifecycle_latencies(metrics: EngineMetrics, clock: FakeClock) -> None:
    metrics.request_arrived("r1")
    clock.t = 0.5
    metrics.request_admitted("r1", prompt_tokens=12)
    for t in (1.0, 1.1, 1.3):
        clock.t = t
        metrics.record_token("r1")
    metrics.request_finished("r1")

    snap = metrics.snapshot(running=0, waiting=0)
    assert snap["queue_s"] == {"p50": pytest.approx(0.5), "p99": pytest.approx(0.5)}
    assert snap["ttft_s"]["p50"] == pytest.approx(1.0)
    assert snap["itl_s"]["p50"] == pytest.approx(0.15)  # gaps 0.1 and 0.2
    assert snap["itl_s"]["p99"] == pytest.approx(0.199)
    assert snap["tpot_s"]["p50"] == pytest.approx(0.15)  # (1.3 - 1.0) / 2
    assert snap["prompt_tokens"] == 12
    assert snap["generated_tokens"] == 3
    assert snap["finished"] == 1


def test_single_token_request_has_no_tpot(metrics: EngineMetrics, clock: FakeClock) -> None:
    metrics.request_arrived("r")
    clock.t = 0.2
    metrics.record_token("r")
    metrics.request_finished("r")
    snap = metrics.snapshot()
    assert snap["ttft_s"]["p50"] == pytest.approx(0.2)
    assert snap["tpot_s"] == {"p50": None, "p99": None}
    assert snap["itl_s"] == {"p50": None, "p99": None}


def test_record_tokens_per_step_times_each_request(
    metrics: EngineMetrics, clock: FakeClock
) -> None:
    metrics.request_arrived("a")
    clock.t = 1.0
    metrics.request_arrived("b")
    clock.t = 2.0
    metrics.record_tokens(["a", "b"])
    clock.t = 2.5
    metrics.record_tokens(["a", "b", "unknown"])  # unknown ids still count as tokens
    snap = metrics.snapshot()
    assert snap["generated_tokens"] == 5
    assert sorted(metrics._history["ttft_s"]) == pytest.approx([1.0, 2.0])
    assert snap["itl_s"]["p50"] == pytest.approx(0.5)


def test_steps_and_max_batch_size(metrics: EngineMetrics) -> None:
    for size in (3, 8, 5):
        metrics.record_step(batch_size=size, step_time_s=0.02)
    snap = metrics.snapshot(running=5, waiting=2)
    assert snap["steps"] == 3 and snap["max_batch_size"] == 8
    assert (snap["running"], snap["waiting"]) == (5, 2)


def test_tokens_per_s_uses_elapsed_span_then_sliding_window(
    metrics: EngineMetrics, clock: FakeClock
) -> None:
    assert metrics.tokens_per_s() == 0.0
    clock.t = 10.0
    metrics.record_tokens(range(100))
    assert metrics.tokens_per_s() == pytest.approx(10.0)  # 100 tokens over 10 s so far
    clock.t = 30.0
    metrics.record_tokens(range(200))
    assert metrics.tokens_per_s() == pytest.approx(10.0)  # 300 over 30 s
    clock.t = 65.0
    assert metrics.tokens_per_s() == pytest.approx(300 / 60)  # window 5..65 holds both
    clock.t = 71.0
    assert metrics.tokens_per_s() == pytest.approx(200 / 60)  # t=10 has left the window
    clock.t = 95.0
    metrics.record_tokens(range(60))
    clock.t = 100.0
    assert metrics.snapshot()["tokens_per_s"] == pytest.approx(60 / 60)
    assert metrics.snapshot()["generated_tokens"] == 360


def test_histories_are_bounded(clock: FakeClock) -> None:
    m = EngineMetrics(clock=clock, max_samples=10)
    for i in range(25):
        m.record_step(batch_size=1, step_time_s=float(i))
    assert m.snapshot()["step_s"]["p50"] == pytest.approx(19.5)  # only 15..24 kept
    assert m.snapshot()["steps"] == 25


def test_snapshot_is_json_serialisable(metrics: EngineMetrics, clock: FakeClock) -> None:
    empty = json.loads(json.dumps(metrics.snapshot(running=0, waiting=0)))
    for key in ("running", "waiting", "finished", "prompt_tokens", "generated_tokens",
                "max_batch_size", "tokens_per_s", "steps"):
        assert key in empty
    for key in ("ttft_s", "tpot_s", "itl_s", "queue_s"):
        assert empty[key] == {"p50": None, "p99": None}
    metrics.request_arrived(("tuple", 1))
    clock.t = 1.0
    metrics.record_token(("tuple", 1))
    assert json.loads(json.dumps(metrics.snapshot(1, 0)))["ttft_s"]["p50"] == 1.0


def test_reset_clears_everything(metrics: EngineMetrics, clock: FakeClock) -> None:
    metrics.request_arrived("r")
    clock.t = 1.0
    metrics.request_admitted("r", prompt_tokens=4)
    metrics.record_token("r")
    metrics.record_step(4, 0.01)
    clock.t = 2.0
    metrics.reset()
    clock.t = 3.0
    snap = metrics.snapshot()
    assert snap["generated_tokens"] == snap["prompt_tokens"] == snap["steps"] == 0
    assert snap["max_batch_size"] == 0 and snap["tokens_per_s"] == 0.0
    assert snap["ttft_s"] == {"p50": None, "p99": None}
    metrics.record_token("r")  # forgotten by reset: counted, but not timed
    assert metrics.snapshot()["ttft_s"]["p50"] is None
    assert metrics.tokens_per_s() == pytest.approx(1.0)  # 1 token over 1 s since reset


def test_concurrent_recording_is_not_lost(clock: FakeClock) -> None:
    m = EngineMetrics(clock=clock)

    def work() -> None:
        for _ in range(500):
            m.record_tokens(["x", "y"])
            m.record_step(2, 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = m.snapshot()
    assert snap["generated_tokens"] == 4000 and snap["steps"] == 2000


def test_listeners_receive_samples(metrics: EngineMetrics, clock: FakeClock) -> None:
    seen: list[tuple[str, float]] = []
    metrics.add_listener(lambda name, value: seen.append((name, value)))
    metrics.request_arrived("r")
    clock.t = 0.25
    metrics.request_admitted("r", prompt_tokens=3)
    clock.t = 1.0
    metrics.record_token("r")
    assert seen == [("prompt_tokens", 3.0), ("queue_s", 0.25), ("ttft_s", 1.0),
                    ("generated_tokens", 1.0)]


def test_latencies_fill_cumulative_histograms(metrics: EngineMetrics, clock: FakeClock) -> None:
    metrics.request_arrived("r")
    clock.t = 0.5
    metrics.record_token("r")
    clock.t = 0.53
    metrics.record_token("r")
    ttft, itl = metrics.histograms()["ttft_s"], metrics.histograms()["itl_s"]
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.5)
    # cumulative: 0.5 s is counted in every bucket from le=0.5 up, in none below
    assert ttft.buckets == [1 if b >= 0.5 else 0 for b in LATENCY_BUCKETS]
    assert itl.count == 1 and itl.buckets == [1 if b >= 0.03 else 0 for b in LATENCY_BUCKETS]
    metrics.reset()
    assert metrics.histograms()["ttft_s"].count == 0


def test_a_steps_rows_sharing_a_gap_count_once_each(metrics: EngineMetrics, clock: FakeClock) -> None:
    """Rows of one step mostly share their inter-token latency: each is still one sample, in
    the history, the histogram and what listeners hear."""
    heard: list[float] = []
    metrics.add_listener(lambda name, value: heard.append(value) if name == "itl_s" else None)
    for rid in "abc":
        metrics.request_arrived(rid)
    for t, rows in ((1.0, "ab"), (1.02, "abc"), (1.1, "ab"), (1.15, "abc")):
        clock.t = t
        metrics.record_tokens(rows)
    gaps = [1.02 - 1.0] * 2 + [1.1 - 1.02] * 2 + [1.15 - 1.1] * 2 + [1.15 - 1.02]  # (as the clock's times subtract)
    assert sorted(metrics._history["itl_s"]) == pytest.approx(sorted(gaps))
    assert sorted(heard) == pytest.approx(sorted(gaps))
    itl = metrics.histograms()["itl_s"]
    assert itl.count == 7 and itl.sum == pytest.approx(sum(gaps))
    assert itl.buckets == [sum(g <= b for g in gaps) for b in LATENCY_BUCKETS]
    assert metrics.snapshot()["generated_tokens"] == 10
