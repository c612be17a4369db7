"""Serving metrics from per-request timings, defined as vLLM's ``benchmark_serving`` /
``vllm bench serve`` defines them.

Per successful request (times from when it was sent):

* **TTFT**: until the first chunk carrying output (text, or a tool-call delta);
* **E2EL**: until the response is complete;
* **TPOT**: ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests with more than one
  output token (for goodput a request with one token counts as TPOT 0, as in vLLM);
* **ITL**: the gaps between consecutive output chunks, pooled over all requests (a chunk
  holding several tokens is one gap, as in vLLM).

Throughputs divide by the benchmark's wall time (first send to last completion): request/s,
output tok/s, total (prompt + output) tok/s. Goodput is the request/s of requests meeting
every SLO given (``ttft``, ``tpot``, ``e2el``, in ms, each ``<=``). Percentiles use linear
interpolation (``numpy.percentile``'s default, as vLLM).

Differences from vLLM: where vLLM reports 0 for a metric with no samples (``np.mean([] or 0)``),
this reports None (shown as "n/a"); goodput is None when a system does not measure a
metric its SLO names (e.g. TTFT of a non-streaming peer) rather than counting every request
as bad; prompt tokens are those the system reports when it does (vLLM counts the dataset's);
a server that reports no usage is counted one output token per chunk (vLLM re-tokenizes the
text); failed requests are also counted by kind.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """The client-side timings of one request (``time.perf_counter`` seconds).

    ``chunk_times`` holds the arrival time of every chunk that carried output; a system
    that does not stream leaves it empty (then TTFT, TPOT and ITL are not measured).
    ``prompt_tokens`` starts as the workload's count and is replaced by the system's own
    when it reports one (a server rendering the messages with its own template).
    """

    prompt_tokens: int = 0
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: Optional[str] = None

    def add_chunk(self, tokens: int = 0) -> None:
        """An output chunk arrived now, holding ``tokens`` new tokens (0 if not known)."""
        self.chunk_times.append(time.perf_counter())
        self.output_tokens += tokens

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> Optional[float]:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first; None with one token or no stream."""
        if self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def summarize(values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, Optional[float]]:
    """Mean and percentiles of durations in seconds, as milliseconds (None when empty)."""
    keys = ["mean"] + [f"p{p:g}" for p in percentiles]
    if not len(values_s):
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return dict(zip(keys, [float(ms.mean())] + [float(np.percentile(ms, p)) for p in percentiles]))


def parse_slo(text: Optional[str]) -> dict[str, float]:
    """``"ttft=500,tpot=50"`` (milliseconds; ``2s`` and ``300ms`` also accepted) -> a dict."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {part!r}: expected NAME=MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
        value = value.strip().lower()
        scale = 1.0
        if value.endswith("ms"):
            value = value[:-2]
        elif value.endswith("s"):
            value, scale = value[:-1], 1000.0
        try:
            ms = float(value) * scale
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number") from None
        if ms <= 0:
            raise ValueError(f"bad SLO {part!r}: must be > 0")
        slo[name] = ms
    return slo


def _meets(record: RequestRecord, slo_ms: Mapping[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot if record.tpot is not None else 0.0, "e2el": record.e2el}
    return all(values[name] is not None and values[name] * 1000.0 <= limit for name, limit in slo_ms.items())


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once (half-open intervals [start, end))."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def compute(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ms: Optional[Mapping[str, float]] = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """Every benchmark metric of one run, as a JSON-ready dict (latencies in ms)."""
    ok = [r for r in records if r.ok]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    streamed = [r for r in ok if r.ttft is not None]
    goodput: Optional[float] = None
    if slo_ms:
        needs_stream = "ttft" in slo_ms or "tpot" in slo_ms
        measurable = not needs_stream or (bool(ok) and len(streamed) == len(ok))
        if measurable:
            goodput = sum(_meets(r, slo_ms) for r in ok) / duration_s
    per = lambda xs: summarize(xs, percentiles)  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures": dict(Counter(r.error for r in records if not r.ok)),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": goodput,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(ok),
        "ttft_ms": per([r.ttft for r in streamed]),
        "tpot_ms": per([r.tpot for r in streamed if r.tpot is not None]),
        "itl_ms": per([gap for r in streamed for gap in r.itl]),
        "e2el_ms": per([r.e2el for r in ok]),
    }


def samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-request TTFT and E2EL in ms of the successful requests (for latency CDFs)."""
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": [r.ttft * 1000.0 for r in ok if r.ttft is not None],
        "e2el_ms": [r.e2el * 1000.0 for r in ok],
    }
