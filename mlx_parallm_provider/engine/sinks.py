"""Where the worker hands a request's results: the calling event loop's queue
(:class:`LoopSink`, through ``loop.call_soon_threadsafe``) or a plain thread's
(:class:`ThreadSink`); a step's results for one event loop in one call on it
(:func:`deliver_all`)."""

from __future__ import annotations

import asyncio
import logging
import queue
from typing import Any, Callable, Optional, Sequence, Union

from .embed.request import EmbedRequest
from .request import Request, ResultSink

logger = logging.getLogger(__name__)

Delivery = tuple[Any, object]
"""A request (anything with a ``sink``) and one result for its caller."""


def deliver_all(results: Sequence[Delivery], deliver: Callable[[Any, object], None]) -> None:
    """Hand a step's results over, each request's in order: those bound for one event loop
    in one ``call_soon_threadsafe`` (one wake-up of the loop a step, not one for each row's
    token), the others by ``deliver(request, item)``, as is every result of a loop that has
    closed (its sinks then cancel their requests)."""
    batches: dict[Any, list[Delivery]] = {}
    for request, item in results:
        loop = getattr(request.sink, "loop", None)
        if loop is None:
            deliver(request, item)
        else:
            batches.setdefault(loop, []).append((request, item))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_hand_over, batch)
        except RuntimeError:  # the loop is closed
            for request, item in batch:
                deliver(request, item)


def _hand_over(batch: list[Delivery]) -> None:
    """(On the loop's thread) each result to its sink; one that fails harms no other."""
    for request, item in batch:
        try:
            request.sink.put_on_loop(item)
        except Exception:
            logger.exception("could not hand a result of request %s to its caller", getattr(request, "request_id", "?"))


class LoopSink(ResultSink):
    """Delivers results into an asyncio queue owned by the calling event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request: Optional[Union[Request, EmbedRequest]] = None  # cancelled if the loop closes

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            if self.request is not None:
                self.request.cancelled = True

    def put_on_loop(self, item: object) -> None:
        self.queue.put_nowait(item)

    def abandoned(self) -> bool:
        return self.loop.is_closed()


class ThreadSink(ResultSink):
    """Delivers results into a thread-safe queue read by a plain (blocking) caller."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: object) -> None:
        self.queue.put(item)
