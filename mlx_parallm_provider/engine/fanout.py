"""Fan-out: the many requests of one call (a batch of prompts, ``n`` choices each)
submitted together and gathered in order.

:func:`expand` applies the ``seed + i`` rule; :class:`FanOut` submits in waves that fit
the engine's waiting queue, so a call larger than ``EngineConfig.max_queue`` still runs
(as vLLM runs any ``n``) instead of failing half-queued, and cancels the siblings of a
failed request unless the caller wants every result. A call that does not fit the queue
at once leaves a quarter of it free for other callers while it runs in waves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

from .._validation import check_int
from ..errors import EngineOverloadedError, InvalidParameterError, MLXParallmError
from .request import Completion, Prompt, Request, ResultSink, SamplingParams

#: Most choices one call may ask for (OpenAI's limit). Larger ``n`` would run in waves for
#: minutes, holding a quarter of the queue's worth of rows from every other caller.
MAX_N = 128

#: How often a call waiting for room in a full queue looks again (seconds).
POLL_S = 0.005

Job = tuple[Prompt, SamplingParams]
Result = Union[Completion, BaseException]


def expand(
    prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams], None], n: int = 1
) -> list[Job]:
    """Every prompt ``n`` times, prompt by prompt. ``params`` is one :class:`SamplingParams`
    for all prompts or one per prompt. Choice ``i`` of a seeded request samples with
    ``seed + i``, so each choice is reproducible and the choices differ."""
    check_int("n", n, minimum=1, maximum=MAX_N)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidParameterError("prompts", f"must be a list of prompts, got {type(prompts).__name__}")
    if params is None or isinstance(params, SamplingParams):
        per_prompt = [params or SamplingParams()] * len(prompts)
    else:
        per_prompt = list(params)
        if len(per_prompt) != len(prompts):
            raise InvalidParameterError("params", f"has {len(per_prompt)} entries for {len(prompts)} prompts")
    jobs: list[Job] = []
    for prompt, p in zip(prompts, per_prompt):
        if not isinstance(p, SamplingParams):
            raise InvalidParameterError("params", f"must be SamplingParams, got {type(p).__name__}")
        for i in range(n):
            jobs.append((prompt, p if i == 0 or p.seed is None else dataclasses.replace(p, seed=p.seed + i)))
    return jobs


class TaggedSink(ResultSink):
    """Hands ``(index, item)`` to a queue shared by all requests of one call;
    ``abandoned`` says when that queue's reader is gone (its event loop closed). With
    ``loop``, ``on_loop`` is that queue's own put, called on the loop's thread
    (:meth:`put_on_loop`)."""

    def __init__(self, put: Callable[[object], None], index: int, abandoned: Callable[[], bool] = lambda: False,
                 loop: Any = None, on_loop: Optional[Callable[[object], None]] = None) -> None:
        self._put = put
        self.index = index
        self._abandoned = abandoned
        self.loop, self._on_loop = (loop, on_loop) if on_loop is not None else (None, None)

    def put(self, item: object) -> None:
        self._put((self.index, item))

    def put_on_loop(self, item: object) -> None:
        self._on_loop((self.index, item))  # type: ignore[misc]

    def abandoned(self) -> bool:
        return self._abandoned()


class FanOut:
    """One call's jobs: submitted in waves that fit the queue, results kept in order.

    ``engine`` provides ``_submit``, ``_cancel`` and ``_queue_room`` (the coordinator).
    Drive it with :meth:`submit_ready` and :meth:`deliver` until :attr:`done`.
    """

    def __init__(self, engine: Any, jobs: list[Job], request_id: Optional[str], return_exceptions: bool) -> None:
        self._engine = engine
        self._jobs = jobs
        self._request_id = request_id
        self._return_exceptions = return_exceptions
        self._results: list[Optional[Result]] = [None] * len(jobs)
        self._open: dict[int, Request] = {}
        self._next = 0
        self._finished = 0
        fits = len(jobs) <= engine._queue_room()
        self._reserve = 0 if fits else engine.config.max_queue // 4  # room left to other callers

    @property
    def done(self) -> bool:
        return self._finished == len(self._jobs)

    @property
    def waiting_for_room(self) -> bool:
        """Jobs are left that did not fit the queue yet."""
        return self._next < len(self._jobs)

    @property
    def results(self) -> list[Result]:
        return list(self._results)  # type: ignore[arg-type]

    def submit_ready(self, sink_for: Callable[[int], ResultSink]) -> None:
        """Submit the next jobs while the queue has room.

        Only a call that has submitted nothing yet fails when the queue is full (a true
        overload, worth retrying); once started, a call waits for room instead, keeping
        its reserve free for other callers.
        """
        while self._next < len(self._jobs):
            if self._next and self._engine._queue_room() <= self._reserve:
                return
            index = self._next
            prompt, params = self._jobs[index]
            request_id = None if self._request_id is None else f"{self._request_id}-{index}"
            try:
                request = self._engine._submit(prompt, params, request_id, sink_for(index), stream=False)
            except EngineOverloadedError:
                if self._next == 0:
                    raise
                return
            except MLXParallmError as error:
                self._next += 1
                self.deliver(index, error)
                continue
            self._next += 1
            self._open[index] = request

    def deliver(self, index: int, item: object) -> None:
        """Record one request's result; a failure cancels the siblings and raises unless
        the caller asked for exceptions as results."""
        self._open.pop(index, None)
        self._results[index] = item  # type: ignore[assignment]
        self._finished += 1
        if isinstance(item, BaseException) and not self._return_exceptions:
            self.cancel()
            raise item

    def cancel(self) -> None:
        """Cancel every request still running and submit nothing more."""
        self._next = len(self._jobs)
        open_requests, self._open = list(self._open.values()), {}
        for request in open_requests:
            self._engine._cancel(request)
