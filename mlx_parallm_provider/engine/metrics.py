"""Engine metrics in vLLM vocabulary (TTFT, TPOT, ITL, queue time, throughput).

:class:`EngineMetrics` is updated by the engine's worker thread and read by any thread
through :meth:`EngineMetrics.snapshot`. Latency histories are bounded deques, so memory
stays constant however long the engine runs. Latencies are also counted into cumulative
histogram buckets (:meth:`EngineMetrics.histograms`), which :mod:`.prometheus` exports
under vLLM's metric names.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

Clock = Callable[[], float]
Listener = Callable[[str, float], None]

HISTORY_NAMES = ("ttft_s", "tpot_s", "itl_s", "queue_s", "step_s")

# Upper bounds (seconds) of the cumulative latency histograms, as vLLM's.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class Histogram:
    """Samples counted in their bucket (the first bound of :data:`LATENCY_BUCKETS` at or over
    each; past the last bound, in none), their sum and their count; :attr:`buckets` gives
    Prometheus' cumulative counts."""

    counts: list[int]
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value``, ``times`` over."""
        self.sum += value * times
        self.count += times
        i = bisect.bisect_left(LATENCY_BUCKETS, value)
        if i < len(self.counts):
            self.counts[i] += times

    @property
    def buckets(self) -> list[int]:
        """The samples at or under each bound of :data:`LATENCY_BUCKETS`."""
        return list(itertools.accumulate(self.counts))

# Token counts recorded closer together than this share one sliding-window bucket.
_RATE_RESOLUTION_S = 0.01


def percentile(sorted_values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) of sorted values, linearly interpolated (numpy's
    default method); None when there are no values."""
    if not sorted_values:
        return None
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


def summarize(values: Iterable[float]) -> dict[str, Optional[float]]:
    """``{"p50": ..., "p99": ...}`` of the values (None when empty)."""
    ordered = sorted(values)
    return {"p50": percentile(ordered, 50), "p99": percentile(ordered, 99)}


@dataclass
class _RequestTimes:
    arrival: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_tokens: int = 0


class EngineMetrics:
    """Thread-safe counters and latency histories for one engine.

    The worker calls :meth:`request_arrived`, :meth:`request_admitted`,
    :meth:`record_token` (or :meth:`record_tokens` once per decode step),
    :meth:`record_step` and :meth:`request_finished`; any thread may call
    :meth:`snapshot`.

    Args:
        clock: monotonic time source in seconds (injectable for tests).
        max_samples: samples kept per latency history.
        window_s: span of the sliding window behind ``tokens_per_s``.
    """

    def __init__(
        self,
        clock: Clock = time.perf_counter,
        max_samples: int = 10_000,
        window_s: float = 60.0,
    ) -> None:
        self._clock = clock
        self._max_samples = max_samples
        self._window_s = window_s
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self.reset()

    def reset(self) -> None:
        """Forget every count, sample and in-flight request; restart the rate window."""
        with self._lock:
            self._started = self._clock()
            self._requests: dict[Hashable, _RequestTimes] = {}
            self._history = {name: deque(maxlen=self._max_samples) for name in HISTORY_NAMES}
            self._histograms = {name: Histogram([0] * len(LATENCY_BUCKETS)) for name in HISTORY_NAMES}
            # [time, tokens] buckets for the sliding-window rate; calls closer together
            # than _RATE_RESOLUTION_S share a bucket so its length stays bounded.
            self._token_events: deque[list[float]] = deque()
            self._window_tokens = 0
            self._finished = 0
            self._prompt_tokens = 0
            self._cached_prompt_tokens = 0
            self._prefix_hits = 0
            self._generated_tokens = 0
            self._steps = 0
            self._max_batch_size = 0
            self._embedding_inputs = 0
            self._embedding_tokens = 0
            self._max_embedding_batch = 0

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(name, value)`` for every sample and token count recorded.

        Names: the history names (``"ttft_s"``, ``"itl_s"``, ...), ``"prompt_tokens"``,
        ``"cached_prompt_tokens"`` and ``"generated_tokens"``. Listeners run on the recording thread, outside the lock.
        """
        with self._lock:
            self._listeners.append(listener)

    # -- recording (worker thread) ------------------------------------------------------

    def request_arrived(self, request_id: Hashable) -> None:
        """A request was submitted."""
        now = self._clock()
        with self._lock:
            self._requests[request_id] = _RequestTimes(arrival=now)

    def request_admitted(self, request_id: Hashable, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """A request joined the running batch (its prompt is being prefilled);
        ``cached_tokens`` of its prompt were reused from the prefix cache."""
        now = self._clock()
        events: list[tuple[str, float]] = []
        with self._lock:
            if prompt_tokens:
                self._prompt_tokens += prompt_tokens
                events.append(("prompt_tokens", float(prompt_tokens)))
            if cached_tokens:
                self._cached_prompt_tokens += cached_tokens
                self._prefix_hits += 1
                events.append(("cached_prompt_tokens", float(cached_tokens)))
            req = self._requests.get(request_id)
            if req is not None:
                self._add("queue_s", now - req.arrival, events)
        self._notify(events)

    def record_token(self, request_id: Hashable) -> None:
        """One token was generated for a request."""
        self.record_tokens((request_id,))

    def record_tokens(self, request_ids: Iterable[Hashable]) -> None:
        """One token was generated for each request (one call per decode step)."""
        now = self._clock()
        events: list[tuple[str, float]] = []
        gaps: Counter[float] = Counter()  # inter-token latencies (the rows of one step mostly share theirs)
        with self._lock:
            count = 0
            requests = self._requests
            for rid in request_ids:
                count += 1
                req = requests.get(rid)
                if req is None:  # never announced: count it, but there is nothing to time against
                    continue
                if req.first_token is None:
                    req.first_token = now
                    self._add("ttft_s", now - req.arrival, events)
                else:
                    gaps[now - req.last_token] += 1
                req.last_token = now
                req.num_tokens += 1
            for gap, times in gaps.items():
                self._add("itl_s", gap, events, times)
            if count:
                self._generated_tokens += count
                self._add_to_window(now, count)
                events.append(("generated_tokens", float(count)))
        self._notify(events)

    def record_step(self, batch_size: int, step_time_s: float) -> None:
        """One decode step over ``batch_size`` sequences took ``step_time_s``."""
        events: list[tuple[str, float]] = []
        with self._lock:
            self._steps += 1
            self._max_batch_size = max(self._max_batch_size, batch_size)
            self._add("step_s", step_time_s, events)
        self._notify(events)

    def record_embeddings(self, inputs: int, tokens: int) -> None:
        """One step embedded ``inputs`` inputs of ``tokens`` tokens in all, as one batch."""
        with self._lock:
            self._embedding_inputs += inputs
            self._embedding_tokens += tokens
            self._max_embedding_batch = max(self._max_embedding_batch, inputs)

    def request_finished(self, request_id: Hashable) -> None:
        """A request ended (for any reason); records its TPOT and forgets it."""
        events: list[tuple[str, float]] = []
        with self._lock:
            self._finished += 1
            req = self._requests.pop(request_id, None)
            if req is not None and req.num_tokens > 1:
                assert req.first_token is not None and req.last_token is not None
                tpot = (req.last_token - req.first_token) / (req.num_tokens - 1)
                self._add("tpot_s", tpot, events)
        self._notify(events)

    # -- reading (any thread) -------------------------------------------------------------

    def histograms(self) -> dict[str, Histogram]:
        """A copy of every latency history's cumulative histogram since start or reset."""
        with self._lock:
            return {name: Histogram(list(h.counts), h.sum, h.count) for name, h in self._histograms.items()}

    @property
    def num_tracked(self) -> int:
        """Requests announced and not yet finished (each is timed until it finishes)."""
        with self._lock:
            return len(self._requests)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the sliding window (or the time since start
        or reset, if shorter)."""
        now = self._clock()
        with self._lock:
            return self._rate(now)

    def snapshot(self, running: int = 0, waiting: int = 0) -> dict[str, Any]:
        """A JSON-serialisable view of the metrics; ``running``/``waiting`` are the
        scheduler's current queue sizes."""
        now = self._clock()
        with self._lock:
            histories = {name: list(h) for name, h in self._history.items()}
            snap: dict[str, Any] = {
                "running": int(running),
                "waiting": int(waiting),
                "finished": self._finished,
                "prompt_tokens": self._prompt_tokens,
                "cached_prompt_tokens": self._cached_prompt_tokens,
                "prefilled_prompt_tokens": self._prompt_tokens - self._cached_prompt_tokens,
                "prefix_cache_hits": self._prefix_hits,
                "prefix_cache_hit_rate": self._cached_prompt_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
                "generated_tokens": self._generated_tokens,
                "max_batch_size": self._max_batch_size,
                "tokens_per_s": self._rate(now),
                "steps": self._steps,
                "embedding_inputs": self._embedding_inputs,
                "embedding_tokens": self._embedding_tokens,
                "max_embedding_batch": self._max_embedding_batch,
            }
        # Sorting happens outside the lock so the worker is never held up by a reader.
        snap.update({name: summarize(values) for name, values in histories.items()})
        return snap

    # -- internals (lock held) --------------------------------------------------------------

    def _add(self, name: str, value: float, events: list[tuple[str, float]], times: int = 1) -> None:
        self._history[name].extend([value] * times)
        self._histograms[name].observe(value, times)
        if self._listeners:
            events.extend([(name, value)] * times)

    def _add_to_window(self, now: float, count: int) -> None:
        events = self._token_events
        if events and now - events[-1][0] < _RATE_RESOLUTION_S:
            events[-1][1] += count
        else:
            events.append([now, count])
        self._window_tokens += count
        self._expire(now)

    def _expire(self, now: float) -> None:
        cutoff = now - self._window_s
        events = self._token_events
        while events and events[0][0] <= cutoff:
            self._window_tokens -= int(events.popleft()[1])

    def _rate(self, now: float) -> float:
        self._expire(now)
        span = min(self._window_s, now - self._started)
        if span <= 0:
            return 0.0
        return self._window_tokens / span

    def _notify(self, events: list[tuple[str, float]]) -> None:
        if not self._listeners:
            return
        for name, value in events:
            for listener in self._listeners:
                listener(name, value)


def prefix_stats(enabled: bool, store: Optional[dict[str, Any]], snapshot: dict[str, Any]) -> dict[str, Any]:
    """``stats()["prefix_cache"]``: whether caching is on, the hit rate (cached / all
    prompt tokens) and cached prompt tokens from the metrics ``snapshot``, and the
    store's own counts (bytes, stored tokens, evictions, bound) when there is one."""
    counts = {k: v for k, v in (store or {}).items() if k != "nbytes"}
    return {
        "enabled": enabled,
        "hit_rate": snapshot["prefix_cache_hit_rate"],
        "cached_tokens": snapshot["cached_prompt_tokens"],
        **counts,
    }
