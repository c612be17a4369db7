"""What every system under test implements, and the shared shapes of in-process and
one-at-a-time runners."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

from ..arrivals import drive
from ..metrics import RequestRecord
from ..workloads import BenchRequest

#: called once per finished request (the progress bar)
OnDone = Optional[Callable[[], None]]


@dataclass(frozen=True)
class Sampling:
    """How every request of a benchmark samples: its temperature and filters (off: ``top_p``
    1, ``top_k`` 0, ``min_p`` 0)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def filters(self, explicit: bool = False) -> dict[str, Any]:
        """The filters for a request's body or keywords, by the names vLLM, llama-server and
        mlx-lm's server take: those that are on, or (``explicit``) all of them, so a server
        with filters of its own by default (llama-server) applies these instead."""
        off = Sampling()
        return {name: getattr(self, name) for name in ("top_p", "top_k", "min_p") if explicit or getattr(self, name) != getattr(off, name)}


class SkipSystem(Exception):
    """This system cannot run here (not installed, wrong model kind); the message says why
    in one line."""


class Runner:
    """One system under test: started once, then run at each concurrency level.

    Subclasses implement :meth:`send` (one request, filling its record) and may override
    :meth:`start`, :meth:`stop`, :meth:`before_run`, :meth:`timed` and :meth:`run_info`.
    """

    #: how EOS is handled: "ignored" (every request makes max_tokens tokens) or "honoured"
    eos = "honoured"

    def __init__(self, name: str) -> None:
        self.name = name

    async def start(self) -> None:
        """Load or start whatever the system needs; raise :class:`SkipSystem` if it can't."""

    async def stop(self) -> None:
        """Release what :meth:`start` took."""

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        """Send one request and record its chunks and output tokens into ``record``."""
        raise NotImplementedError

    async def before_run(self) -> None:
        """Called before each run's warm-up (e.g. to reset counters)."""

    def run_info(self) -> dict[str, Any]:
        """After a timed run: ``max_decode_batch``, ``peak_memory_mb`` where known."""
        return {}

    #: how many requests the warm-up sends at once, at most (None: as many as the run)
    warm_up_width: Optional[int] = None

    async def warm_up(self, requests: Sequence[BenchRequest], width: int) -> None:
        """Short untimed requests, ``width`` at once (the first batch of a new size allocates
        and, on a GPU, compiles), so first-use costs stay out of the timings. Failures are
        not raised: the timed requests will record theirs."""
        short = [replace(r, max_tokens=min(4, r.max_tokens)) for r in requests[: min(width, self.warm_up_width or width)]]
        await asyncio.gather(*(self.send(r, RequestRecord()) for r in short), return_exceptions=True)

    async def run(self, requests: Sequence[BenchRequest], offsets: Sequence[float], max_concurrency: Optional[int],
                  on_done: OnDone = None) -> tuple[list[RequestRecord], float]:
        """Warm up, then send the requests at their offsets; returns the records and the wall time."""
        await self.before_run()
        await self.warm_up(requests, max_concurrency or len(requests))
        return await self.timed(requests, offsets, max_concurrency, on_done)

    async def timed(self, requests: Sequence[BenchRequest], offsets: Sequence[float], max_concurrency: Optional[int],
                    on_done: OnDone) -> tuple[list[RequestRecord], float]:
        """The timed part of :meth:`run`: each request through :meth:`send` at its offset."""
        return await drive(requests, self.send, offsets, max_concurrency, on_done)


class OneAtATime(Runner):
    """A system that serves one request at a time from a blocking token iterator (run in a
    thread): requests queue behind each other, so their TTFT includes the wait."""

    _lock: Optional[asyncio.Lock] = None
    warm_up_width = 1  # requests would only queue

    def tokens(self, request: BenchRequest) -> Iterator[int]:
        """Generate one request; yield the number of new tokens of each output chunk."""
        raise NotImplementedError

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()

        def generate() -> None:
            for count in self.tokens(request):
                if count:
                    record.add_chunk(count)

        async with self._lock:
            await asyncio.to_thread(generate)
