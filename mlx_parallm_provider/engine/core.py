"""The engine's core: one thread that owns the model and runs the step loop.

Each step (:meth:`EngineCore.step`): take new arrivals, drop cancelled and timed-out rows,
then ``plan = scheduler.schedule()``, ``out = runner.run(plan)``,
``scheduler.update(plan, out)``, and hand each result to its caller. The scheduler
(:mod:`.scheduler`) owns every request's progress; the runner (:mod:`.runner`) executes one
plan on the model; the KV manager (:mod:`.kv`) owns KV memory. Rows join the decode batch
the step after their prefill ends and leave it the step they finish.

Isolation: a fault while setting up, sampling, detokenising or delivering one request fails
it alone (:class:`RequestFailedError`). Every request lives in the inbox or the scheduler
until retired, so when the model step fails or a shutdown outlasts its window
(:mod:`.exit_guard`), every waiter gets :class:`EngineDeadError`. Cancellations and
deadlines are honoured between prefill pieces (one ``prefill_chunk_size``).

KV: blocks the scheduler hands out (the plan carries their tables to the runner), so rows
join and leave without moving anyone's KV; a request admitted with cached prompt blocks
(prefix caching) computes only the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import EngineConfig
from ..errors import EngineDeadError
from ..models import backends
from .detokenize import TextStream, direct_decoder
from .drafting import Drafting
from .embed.request import EmbedRequest
from .exit_guard import register, wait_for_native_exit
from .grammar.guided import GrammarTokenizer
from .kv.build import kv_for_engine
from .metrics import EngineMetrics
from .output import RowState, eos_token_ids
from .request import Request
from .runner import ModelRunner
from .sampling import RowSampler
from .scheduler import Scheduler
from .sinks import deliver_all
from .token_bans import TokenBans

logger = logging.getLogger(__name__)


WORKER_THREAD_NAME = "mlx-parallm-worker"  # what profilers show for the step loop's thread

class EngineCore:
    """Runs the step loop on its own thread. Other threads only call :meth:`submit`,
    :meth:`wake`, :meth:`stop` and read the counters."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig,
        metrics: EngineMetrics,
        kv_bytes_per_token: int,
        vocab_size: int = 0,
        clock: Callable[[], float] = time.monotonic,
        context_length: int = 4096,
        model_path: Optional[Path] = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = direct_decoder(tokenizer)  # (the requests' text streams decode through it)
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.kv_bytes_per_token = max(1, kv_bytes_per_token)
        self.eos_ids = eos_token_ids(tokenizer)
        self.pad_id = next(iter(self.eos_ids), 0)
        self.memory = kv_for_engine(model, config, self.kv_bytes_per_token, context_length, model_path)
        self.kv = self.memory.manager
        self.drafting = Drafting.for_engine(config)  # None: one token a row a step
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.prefill_chunk_size, self.kv,
                                   prefix_caching=config.enable_prefix_caching, prefix_capacity_tokens=self.kv.capacity_tokens,
                                   eos_ids=self.eos_ids, drafting=self.drafting, metrics=metrics, tokenizer=tokenizer,
                                   stream_interval=config.stream_interval, decode_ahead=config.async_scheduling)
        self.runner = ModelRunner(model, self.memory.storage, self.pad_id, self.memory.windows, self.memory.groups,
                                  wanted=self._wanted, metrics=metrics, decode_ahead=config.async_scheduling,
                                  prefill_chunk_size=config.prefill_chunk_size, states=self.memory.states)
        self.grammar = GrammarTokenizer(tokenizer, vocab_size, self.eos_ids)
        self._inbox: deque[Request] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._stop_deadline: Optional[float] = None
        self.dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=WORKER_THREAD_NAME, daemon=True)
        register(self)
        self._thread.start()

    def kv_stats(self) -> dict[str, Any]:
        """``stats()["kv_cache"]``: blocks, usage, preemptions."""
        return self.memory.stats()

    def memory_stats(self, cached_tokens: int) -> dict[str, Any]:
        """``stats()``'s ``kv_cache``, ``kv_disk`` and ``kv_tiers`` (``cached_tokens``: the
        metrics' ``cached_prompt_tokens``)."""
        return {"kv_cache": self.kv_stats(), "kv_disk": self.disk_stats(), "kv_tiers": self.tier_stats(cached_tokens)}

    def disk_stats(self) -> Optional[dict[str, Any]]:
        """``stats()["kv_disk"]``: the disk tier's counts, or None without one."""
        return self.memory.disk_stats()

    def tier_stats(self, cached_tokens: int) -> dict[str, dict[str, int]]:
        """``stats()["kv_tiers"]``: each prefix store tier's hit tokens (of ``cached_tokens``
        in all), bytes and evictions."""
        return self.memory.tier_stats(cached_tokens)

    def prefix_store_stats(self) -> Optional[dict[str, Any]]:
        """The prefix store's counts (bytes, tokens, evictions, bound), or None without one."""
        return self.memory.prefix_stats() if self.config.enable_prefix_caching else None

    def drafting_stats(self) -> dict[str, Any]:
        """``{"speculation": ..., "fast_forward": ...}``, each None when off."""
        return self.drafting.stats() if self.drafting is not None else {"speculation": None, "fast_forward": None}

    # -- called from other threads ------------------------------------------------------

    def submit(self, request: Request | EmbedRequest) -> bool:
        """Queue a request; False if this worker is dead or stopping (start another)."""
        with self._cond:
            if self.dead is not None or self._stopping:
                return False
            self._inbox.append(request)
            self._cond.notify()
        return True

    def wake(self) -> None:
        """Make the loop look at its requests now (after a cancellation)."""
        with self._cond:
            self._cond.notify()

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Finish the current step, fail what is left, end the thread; True once it has. Past
        ``timeout`` (default ``config.shutdown_timeout_s``, one window however often called)
        with the step still computing, every request held fails with :class:`EngineDeadError`."""
        window = self.config.shutdown_timeout_s if timeout is None else timeout
        with self._cond:
            self._stopping = True
            self._stop_deadline = self._stop_deadline or time.monotonic() + window
            self._cond.notify()
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(max(0.0, self._stop_deadline - time.monotonic()))
        if self._thread.is_alive():
            self._fail_all(EngineDeadError("the engine was shut down while a step was still computing"), from_outside=True)
            return False
        wait_for_native_exit(self._thread, window)
        return True

    @property
    def computing(self) -> bool:  # after stop(): inside its last step
        return self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._stopping and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """No request queued or held (read under the inbox's lock, so one moving from the inbox
        to the scheduler is seen in one or the other)."""
        with self._cond:
            return not self._inbox and not self.scheduler.all_requests()

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self.step():
                pass
            self._fail_all(EngineDeadError("the engine was shut down"))
        except BaseException as exc:  # the worker itself died: nobody may hang
            logger.exception("mlx-parallm worker died")
            # Its traceback's frames hold this worker's arrays (KV cache, logits) in a
            # reference cycle: drop it (it is logged) so that memory goes back at once.
            exc.__traceback__ = None
            with self._cond:
                self.dead = exc
            self._fail_all(EngineDeadError(f"the engine's worker died ({type(exc).__name__}: {exc}); retry the request"))
        finally:
            self._save_pending()
            self.memory.close()  # the disk tier's queued blocks written

    def _save_pending(self) -> None:
        """Hand the disk tier the blocks named since the last step (a last answer's)."""
        try:
            saves = self.kv.for_step([]).saves
            if saves:
                self.kv.disk.to_disk(self.memory.storage.saved_blocks(saves))  # type: ignore[union-attr]
        except Exception:
            logger.exception("could not save the last KV blocks to the disk tier")

    def step(self) -> bool:
        """One engine step; False once the engine is stopping."""
        if not self._take_arrivals():
            return False
        self._reap()
        plan = self.scheduler.schedule()
        out = self.runner.run(plan)
        deliver_all(self.scheduler.update(plan, out), self._deliver)
        return True

    def _take_arrivals(self) -> bool:
        """Move new requests to the scheduler, blocking while idle; False: stop."""
        with self._cond:
            idle = not self.scheduler.all_requests() and not (self.kv.disk and self.kv.disk.pending_saves)  # (one more step saves them)
            while not self._inbox and idle and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return False
            if idle and self.config.batch_window_ms > 0:
                # Gather window: let a burst arrive so it is prefilled as one batch.
                deadline = time.monotonic() + self.config.batch_window_ms / 1000
                while len(self._inbox) < self.config.max_num_seqs and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            # Each request moves from the inbox straight into the scheduler, so it is never
            # held only in a local list: if anything fails, _fail_all still finds it.
            arrivals = []
            while self._inbox:
                arrivals.append(self._inbox.popleft())
                self.scheduler.add(arrivals[-1])
        for request in arrivals:
            if not isinstance(request, EmbedRequest):  # (an embedding call needs no sampler or text)
                self._set_up(request)
        return True

    def _set_up(self, request: Request) -> None:
        """Give a new request its sampler and text stream; a fault fails it alone."""
        if request.cancelled or request.sink.abandoned():
            self._drop(request)
            return
        try:
            request.state = RowState(
                sampler=RowSampler(request.params, self.grammar if request.params.constraint else None,
                                   ops=backends.of(self.model), bans=TokenBans.of(request.params, self.eos_ids, request.bad_word_ids)),
                text=TextStream(self.decoder, request.params.stop, request.prompt_ids,
                                include_stop=request.params.include_stop_str_in_output,
                                skip_special_tokens=request.params.skip_special_tokens, unchecked=request.params.min_tokens),
                logprobs=[] if request.params.logprobs else None,
                prompt_logprobs=None if request.params.prompt_logprobs is None else [None] * request.prompt_len,
            )
        except Exception as exc:
            self._fail(request, exc, "while being set up")

    def _reap(self) -> None:
        """Drop cancelled or abandoned requests, fail those past their deadline, wherever they are."""
        now = self.clock()
        for request in self.scheduler.all_requests():
            if request.cancelled or request.sink.abandoned():
                self._drop(request)
            elif request.deadline is not None and now >= request.deadline:
                self._fail(request, request.timeout_error())

    # -- leaving ------------------------------------------------------------------------

    def _drop(self, request: Request) -> None:  # cancelled: its caller has gone, nothing is delivered
        self.scheduler.retire(request)
        request.state = None

    def _deliver(self, request: Request, item: object) -> None:
        """Hand one result to the request's caller; a broken sink cancels the request."""
        try:
            request.sink.put(item)
        except Exception:
            logger.exception("could not deliver a result of request %s; cancelling it", request.request_id)
            request.cancelled = True

    def _fail(self, request: Request, exc: BaseException, during: str = "") -> None:
        """Fail one request alone (:meth:`.Scheduler.fail`) and tell its caller."""
        self._deliver(*self.scheduler.fail(request, exc, during))

    def _wanted(self, request: Request) -> bool:
        """Whether a request is still wanted: not finished, cancelled, abandoned or past its deadline."""
        return not (request.finished or request.cancelled or request.sink.abandoned()
                    or (request.deadline is not None and self.clock() >= request.deadline))

    def _fail_all(self, exc: BaseException, from_outside: bool = False) -> None:
        """Fail every request held. ``from_outside``: by another thread during a step, so the
        lists stay as they are (requests marked finished; the worker's last call skips them)."""
        with self._cond:
            pending = list(self._inbox)
            self._inbox.clear()
            self._stopping = True
        held = self.scheduler.all_requests() if from_outside else self.scheduler.clear()
        for request in [*held, *pending]:
            if not request.finished:
                request.finished = True
                if getattr(request, "adapter", None) is not None:
                    request.adapter.release()
                self.metrics.request_finished(request.request_id)
                self._deliver(request, exc)
