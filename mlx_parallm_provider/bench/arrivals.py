"""When each request is sent: a burst, a fixed concurrency, or Poisson / gamma arrivals.

As in vLLM's serving benchmark: with ``request_rate`` infinite every request is due at once;
otherwise the gaps between requests follow a gamma distribution of shape ``burstiness`` and
mean ``1 / request_rate`` (``burstiness=1`` is a Poisson process; below 1 burstier, above 1
more regular), rescaled so that the last request is due at ``num_requests / request_rate``.
``max_concurrency`` caps the requests in flight (a request past the cap waits client-side,
and its TTFT starts when it is actually sent).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Optional

import numpy as np

from .metrics import RequestRecord
from .workloads import BenchRequest

Send = Callable[[BenchRequest, RequestRecord], Awaitable[None]]


def arrival_offsets(groups: Sequence[int], request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is due.

    ``groups`` has one entry per request; requests of the same group (the ``n`` samples
    of one prompt) share one arrival.
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    distinct = list(dict.fromkeys(groups))
    if math.isinf(request_rate) or not distinct:
        due = {g: 0.0 for g in distinct}
    else:
        if math.isinf(burstiness):
            gaps = np.full(len(distinct), 1.0 / request_rate)
        else:
            rng = np.random.default_rng(seed)
            gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=len(distinct))
        cumulative = np.cumsum(gaps)
        cumulative *= (len(distinct) / request_rate) / cumulative[-1]
        due = dict(zip(distinct, cumulative.tolist()))
    return [due[g] for g in groups]


def failure_kind(exc: BaseException) -> str:
    """A short name for a failure: an exception's ``kind`` attribute, else its class name."""
    kind = getattr(exc, "kind", None)
    return kind if isinstance(kind, str) else type(exc).__name__


async def drive(
    requests: Sequence[BenchRequest],
    send: Send,
    offsets: Sequence[float],
    max_concurrency: Optional[int] = None,
    on_done: Optional[Callable[[], None]] = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its offset (at most ``max_concurrency`` in flight) and wait for all.

    Returns one record per request (failures recorded, never raised) and the wall time from
    the start to the last completion.
    """
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(prompt_tokens=r.prompt_tokens) for r in requests]
    start = time.perf_counter()

    async def one(request: BenchRequest, record: RequestRecord, offset: float) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        try:
            record.start = time.perf_counter()
            await send(request, record)
        except Exception as exc:  # every failure is a measurement, not a crash
            record.error = failure_kind(exc)
        finally:
            record.end = time.perf_counter()
            if limit is not None:
                limit.release()
            if on_done is not None:
                on_done()

    await asyncio.gather(*(one(r, rec, off) for r, rec, off in zip(requests, records, offsets)))
    return records, time.perf_counter() - start
