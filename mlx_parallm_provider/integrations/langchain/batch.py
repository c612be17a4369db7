"""Sync ``batch`` without a thread per input.

LangChain's default ``Runnable.batch`` invokes each input from a thread pool only
``cpu_count + 4`` wide, so a sync batch would decode only that many rows at once. Here
the inputs are invoked one after another from the calling thread, with LangChain's
callbacks, caching and errors per input as usual; the first model call of the batch
submits every input's request to the engine at once (``generate_many_sync``), and each
input's own call then takes its answer. One input's bad request is that input's error.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from langchain_core.language_models import LanguageModelInput
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list

from ...engine import Completion, EngineLike, SamplingParams

#: (engine, prompt, params) of one input, or None when preparing it failed.
Job = Optional[tuple[EngineLike, Any, SamplingParams]]

_current: contextvars.ContextVar[Optional["SyncBatch"]] = contextvars.ContextVar("mlx_parallm_sync_batch", default=None)


class SyncBatch:
    """The answers of one sync batch, generated together on first use."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self._jobs = [job for job in jobs if job is not None]
        self._results: Optional[list[Any]] = None

    def take(self, engine: EngineLike, prompt: Any, params: SamplingParams) -> Optional[Completion]:
        """This request's completion (raising its error), or None if it is not in the batch."""
        if self._results is None:
            self._results = self._run()
        for i, (job_engine, job_prompt, job_params) in enumerate(self._jobs):
            if job_engine is engine and job_prompt == prompt and job_params == params:
                result = self._results[i]
                del self._jobs[i], self._results[i]
                if isinstance(result, BaseException):
                    raise result
                return result
        return None

    def _run(self) -> list[Any]:
        results: list[Any] = [None] * len(self._jobs)
        for engine in {id(job[0]): job[0] for job in self._jobs}.values():
            indexes = [i for i, job in enumerate(self._jobs) if job[0] is engine]
            prompts = [self._jobs[i][1] for i in indexes]
            params = [self._jobs[i][2] for i in indexes]
            for i, result in zip(indexes, engine.generate_many_sync(prompts, params, return_exceptions=True)):
                results[i] = result
        return results


def prefetched(engine: EngineLike, prompt: Any, params: SamplingParams) -> Optional[Completion]:
    """Inside a sync batch: this request's completion, generated with the whole batch."""
    batch = _current.get()
    return None if batch is None else batch.take(engine, prompt, params)


def run_sync_batch(
    runnable: Runnable,
    inputs: Sequence[Any],
    configs: Sequence[RunnableConfig],
    prepare: Callable[[Any], tuple[EngineLike, Any, SamplingParams]],
    *,
    return_exceptions: bool,
    **kwargs: Any,
) -> list[Any]:
    """Invoke ``runnable`` on each input from this thread, its requests batched together
    (``max_concurrency`` inputs at a time when set). ``prepare(input)`` gives the request
    the input's model call will make."""
    width = configs[0].get("max_concurrency") if configs else None
    width = width if isinstance(width, int) and width > 0 else max(1, len(inputs))
    outputs: list[Any] = []
    for start in range(0, len(inputs), width):
        group = range(start, min(start + width, len(inputs)))
        token = _current.set(SyncBatch([_try(prepare, inputs[i]) for i in group]))
        try:
            for i in group:
                try:
                    outputs.append(runnable.invoke(inputs[i], configs[i], **kwargs))
                except Exception as error:
                    if not return_exceptions:
                        raise
                    outputs.append(error)
        finally:
            _current.reset(token)
    return outputs


class BatchesFromOneThread:
    """Mixin for a LangChain model: sync ``batch`` through :func:`run_sync_batch`."""

    def _batch_request(self, value: LanguageModelInput, stop: Optional[list[str]], kwargs: dict[str, Any]) -> tuple[EngineLike, Any, SamplingParams]:
        """The request the model call for input ``value`` will make."""
        raise NotImplementedError

    def _batch_per_input(self, return_exceptions: bool) -> bool:
        """Whether this batch runs one model call per input (else LangChain's own way)."""
        return True

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: Union[RunnableConfig, list[RunnableConfig], None] = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        if len(inputs) < 2 or not self._batch_per_input(return_exceptions):
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)  # type: ignore[misc]

        def request(value: LanguageModelInput) -> tuple[EngineLike, Any, SamplingParams]:
            rest = dict(kwargs)
            return self._batch_request(value, rest.pop("stop", None), rest)

        configs = get_config_list(config, len(inputs))
        return run_sync_batch(self, inputs, configs, request, return_exceptions=return_exceptions, **kwargs)  # type: ignore[arg-type]


def _try(prepare: Callable[[Any], tuple[EngineLike, Any, SamplingParams]], value: Any) -> Job:
    try:
        return prepare(value)
    except Exception:  # the input's own invoke raises this error, with its callbacks
        return None
