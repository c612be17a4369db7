"""Benchmark metric arithmetic on synthetic timings, against vLLM's definitions
(benchmark_serving / ``vllm bench serve``: TPOT = (E2EL - TTFT) / (tokens - 1) for requests
with more than one token, ITL pooled per chunk, numpy's linear percentiles, goodput as the
rate of requests meeting every SLO with TPOT 0 for one-token requests)."""

from __future__ import annotations

import pytest

from mlx_parallm_provider.bench.metrics import RequestRecord, compute, parse_slo, peak_concurrency, samples, summarize


def _records() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, E2EL 600 ms, 4 tokens: TPOT 500/3 ms, ITL 200 and 300 ms
        RequestRecord(prompt_tokens=10, start=0.0, end=0.6, chunk_times=[0.1, 0.3, 0.6], output_tokens=4),
        # one token: no TPOT sample, TPOT 0 for goodput, no ITL
        RequestRecord(prompt_tokens=20, start=1.0, end=1.5, chunk_times=[1.5], output_tokens=1),
        RequestRecord(prompt_tokens=30, start=0.0, end=0.1, error="http_503"),
        # chunks of two tokens: TTFT 200 ms, TPOT 700/7 = 100 ms, ITL 200 ms x3 (one per chunk)
        RequestRecord(prompt_tokens=40, start=0.0, end=0.9, chunk_times=[0.2, 0.4, 0.6, 0.8], output_tokens=8),
    ]


def test_counts_and_throughputs_use_only_successful_requests() -> None:
    m = compute(_records(), duration_s=2.0)
    assert (m["completed"], m["failed"], m["failures"]) == (3, 1, {"http_503": 1})
    assert m["total_input_tokens"] == 70 and m["total_output_tokens"] == 13
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(6.5)
    assert m["total_token_throughput"] == pytest.approx(41.5)
    assert m["request_goodput"] is None  # no SLO given


def test_ttft_e2el_mean_and_linear_percentiles() -> None:
    m = compute(_records(), duration_s=2.0)
    # TTFT 100, 500, 200 ms: sorted 100 200 500; p90 at rank 1.8 = 200 + 0.8 * 300
    assert m["ttft_ms"]["mean"] == pytest.approx(800 / 3)
    assert m["ttft_ms"]["p50"] == pytest.approx(200)
    assert m["ttft_ms"]["p90"] == pytest.approx(440)
    assert m["ttft_ms"]["p99"] == pytest.approx(494)
    assert m["e2el_ms"]["p50"] == pytest.approx(600)  # 500, 600, 900


def test_tpot_excludes_one_token_requests_and_itl_is_per_chunk() -> None:
    m = compute(_records(), duration_s=2.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((500 / 3 + 100) / 2)
    assert m["tpot_ms"]["p50"] == pytest.approx((500 / 3 + 100) / 2)
    # ITL pooled: 200, 300 from the first request, 200 x3 from the last
    assert m["itl_ms"]["mean"] == pytest.approx(220)
    assert m["itl_ms"]["p50"] == pytest.approx(200)
    assert m["itl_ms"]["p90"] == pytest.approx(260)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    both = compute(_records(), 2.0, slo_ms={"ttft": 250, "tpot": 150})
    assert both["request_goodput"] == pytest.approx(0.5)  # only the last request
    tpot_only = compute(_records(), 2.0, slo_ms={"tpot": 150})
    assert tpot_only["request_goodput"] == pytest.approx(1.0)  # one-token request counts as TPOT 0
    e2el = compute(_records(), 2.0, slo_ms={"e2el": 600})
    assert e2el["request_goodput"] == pytest.approx(1.0)  # 500 and 600 ms are within (<=)


def test_goodput_is_none_when_a_named_metric_is_not_measured() -> None:
    unstreamed = [RequestRecord(prompt_tokens=5, start=0.0, end=1.0, output_tokens=8)]
    m = compute(unstreamed, 1.0, slo_ms={"ttft": 1000})
    assert m["request_goodput"] is None and m["ttft_ms"]["p50"] is None and m["tpot_ms"]["mean"] is None
    assert compute(unstreamed, 1.0, slo_ms={"e2el": 2000})["request_goodput"] == pytest.approx(1.0)


def test_summarize_empty_and_custom_percentiles() -> None:
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summarize([0.001, 0.003], percentiles=[25]) == {"mean": pytest.approx(2.0), "p25": pytest.approx(1.5)}


def test_peak_concurrency_uses_half_open_intervals() -> None:
    rs = [RequestRecord(start=0, end=1), RequestRecord(start=1, end=2), RequestRecord(start=0.5, end=1.5)]
    assert peak_concurrency(rs) == 2
    assert peak_concurrency([]) == 0


def test_samples_are_per_request_milliseconds_of_successes() -> None:
    s = samples(_records())
    assert s["ttft_ms"] == pytest.approx([100, 500, 200])
    assert s["e2el_ms"] == pytest.approx([600, 500, 900])


@pytest.mark.parametrize(
    "text, expected",
    [("ttft=500,tpot=50", {"ttft": 500.0, "tpot": 50.0}), ("e2el=2s", {"e2el": 2000.0}), ("TTFT=300ms", {"ttft": 300.0}), (None, {})],
)
def test_parse_slo(text: str, expected: dict) -> None:
    assert parse_slo(text) == expected


@pytest.mark.parametrize("text", ["latency=5", "ttft", "ttft=fast", "tpot=0"])
def test_parse_slo_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo(text)
