"""Where the worker hands a request's results: the calling event loop's queue
(:class:`LoopSink`, through ``loop.call_soon_threadsafe``) or a plain thread's
(:class:`ThreadSink`)."""

from __future__ import annotations

import asyncio
import queue
from typing import Optional, Union

from .embed.request import EmbedRequest
from .request import Request, ResultSink


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

    def abandoned(self) -> bool:
        return self.loop.is_closed()


class ThreadSink(ResultSink):
    """Delivers results into a thread-safe queue read by a plain (blocking) caller."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: object) -> None:
        self.queue.put(item)
