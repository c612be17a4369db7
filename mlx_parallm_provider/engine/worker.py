"""The MLX side: one thread that owns the model and the step loop.

Each step: take new arrivals, drop cancelled and timed-out rows, ask the scheduler for a
plan, prefill (new prompts and/or one chunk of a long prompt), embed (:mod:`.embed_forward`),
then decode one token of every running row (or verify their drafts: :mod:`.drafts`).
Rows join the decode batch when their prefill ends and leave it the step they finish.

Isolation: a fault while setting up, sampling, detokenising or delivering one request fails
it alone (:class:`RequestFailedError`). Every request lives in the inbox or the scheduler
until retired, so when the model step fails or a shutdown outlasts its window
(:mod:`.exit_guard`), every waiter gets :class:`EngineDeadError`. Cancellations and
deadlines are honoured between prefill pieces (one ``prefill_chunk_size``).

KV: blocks the scheduler hands out (:mod:`.kv.runner` runs the passes over them), so rows
join and leave without moving anyone's KV; a request admitted with cached prompt blocks
(prefix caching) computes only the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import mlx.core as mx

from ..config import EngineConfig
from ..errors import EngineDeadError, MLXParallmError, as_request_error
from .decode_ahead import DecodeAhead
from .detokenize import TextStream
from .drafts import Drafts
from .embed_forward import embed_step
from .embedding import EmbedRequest
from .exit_guard import register, wait_for_native_exit
from .guided import GrammarTokenizer
from .kv.runner import PagedRunner
from .metrics import EngineMetrics
from .output import RowState, emit, eos_token_ids
from .request import Request
from .sampling import RowSampler, sample_requests
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


class Worker:
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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.kv_bytes_per_token = max(1, kv_bytes_per_token)
        self.eos_ids = eos_token_ids(tokenizer)
        self.pad_id = next(iter(self.eos_ids), 0)
        self.paged = PagedRunner.for_model(model, config, self.kv_bytes_per_token, context_length, self.pad_id)
        self.kv = self.paged.kv  # (the scheduler's block tables)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.prefill_chunk_size, self.kv,
                                   **self.paged.prefix_options(config), eos_ids=self.eos_ids)
        self.grammar = GrammarTokenizer(tokenizer, vocab_size, self.eos_ids)
        self.drafts = Drafts.for_engine(config)  # None: one token a row a step
        drafting = self.drafts.would_verify if self.drafts is not None else (lambda rows: False)
        self.ahead = DecodeAhead(self.paged, self.scheduler, drafting) if config.async_scheduling else None
        self._inbox: deque[Request] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._stop_deadline: Optional[float] = None
        self.dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mlx-parallm-worker", daemon=True)
        register(self)
        self._thread.start()

    def kv_stats(self) -> dict[str, Any]:
        """``stats()["kv_cache"]``: blocks, usage, preemptions."""
        return self.paged.stats()

    def prefix_store_stats(self) -> Optional[dict[str, Any]]:
        """The prefix store's counts (bytes, tokens, evictions, bound), or None without one."""
        return self.paged.prefix_stats(self.kv_bytes_per_token)

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
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._next_step():
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

    def _next_step(self) -> bool:
        if not self._take_arrivals():
            return False
        self._reap()
        plan = self.scheduler.schedule()
        self.paged.reserve()  # the blocks the plan hands out
        if plan.chunk is not None and not plan.chunk[0].finished:
            self._prefill_chunk(*plan.chunk)
            self._reap()
        prefill = [r for r in plan.prefill if not r.finished]
        if prefill:
            self._prefill(prefill)
            self._reap()
        done, failed = embed_step(self.model, plan.embed, self.pad_id, self.metrics)  # a failure fails only its calls
        for request, exc in failed:
            self._fail(request, exc, "while embedding its inputs")
        for request in done:
            self._retire(request)
            self._deliver(request, request.result())
        rows = plan.decoding()
        if rows:
            self._decode(rows)
        return True

    def _take_arrivals(self) -> bool:
        """Move new requests to the scheduler, blocking while idle; False: stop."""
        with self._cond:
            idle = not self.scheduler.all_requests()
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
                sampler=RowSampler(request.params, self.grammar if request.params.constraint else None),
                text=TextStream(self.tokenizer, request.params.stop, request.prompt_ids),
                logprobs=[] if request.params.logprobs else None,
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

    # -- prefill ------------------------------------------------------------------------

    def _wanted(self, requests: list[Request]) -> Callable[[], list[bool]]:
        """Between prefill pieces: reap, then say which of ``requests`` are still wanted."""
        def wanted() -> list[bool]:
            self._reap()
            return [not r.finished for r in requests]
        return wanted

    def _prefill(self, requests: list[Request]) -> None:
        """Prefill whole prompts (or what follows their cached prefix) as one batch, in
        pieces of about ``prefill_chunk_size`` tokens in all (cancelled and timed-out rows
        leave between pieces), and sample each first token."""
        for r in requests:
            if not r.num_preemptions:
                self.metrics.request_admitted(r.request_id, r.prompt_len, cached_tokens=r.num_cached)
        piece = max(1, self.config.prefill_chunk_size // len(requests))
        ran = self.paged.prefill(requests, piece, lambda rows: self._wanted(rows)())
        if ran is not None:
            self._join_decode_batch(*ran)

    def _prefill_chunk(self, request: Request, n: int) -> None:
        """Prefill the next ``n`` prompt tokens of a long prompt into its blocks."""
        if request.num_prefilled == request.num_cached and not request.num_preemptions:  # its first chunk
            self.metrics.request_admitted(request.request_id, request.prompt_len, cached_tokens=request.num_cached)
        logits = self.paged.chunk(request, n)
        self.scheduler.advanced(request, n)
        if logits is not None:
            self._join_decode_batch([request], logits)

    def _join_decode_batch(self, requests: list[Request], logits: mx.array) -> None:
        sampled = sample_requests(logits, requests)
        self.scheduler.started(requests)  # (their prompts, + output if recomputed, are cached)
        self._after_sampling(requests, sampled)

    # -- decode -------------------------------------------------------------------------

    def _decode(self, rows: list[Request]) -> None:
        """One decode step (or draft verification) of exactly these rows (the plan's)."""
        tic = time.perf_counter()
        ahead = self.ahead.step(rows) if self.ahead is not None else None  # (plain rows: see .decode_ahead)
        drafted = self.drafts.decode(self.paged, rows) if self.drafts is not None and ahead is None else None
        if ahead is not None:
            (rows, sampled), k = ahead, 0
        elif drafted is not None:  # accepted drafts + one sampled token a row
            sampled, k = drafted
        else:
            logits = self.paged.decode(rows)
            sampled, k = sample_requests(logits, rows), 0
        seconds = time.perf_counter() - tic
        self.metrics.record_step(len(rows), seconds)
        if self.drafts is not None:  # what a step of this width costs, for its next plan
            self.drafts.record(len(rows), k, seconds)
        self._after_sampling(rows, sampled)
        if self.drafts is not None:  # before the next plan, which makes room for the drafts
            self.drafts.draft_all([r for r in rows if not r.finished])
        logger.debug("decode step: batch=%d drafts=%d waiting=%d step_ms=%.1f", len(rows), k, self.scheduler.num_waiting, seconds * 1000)

    def _after_sampling(self, rows: list[Request], sampled: list[Any]) -> None:
        """Take each row's sampled token (a list of them: accepted drafts, in order)."""
        sampled = [got if isinstance(got, list) else [got] for got in sampled]
        self.metrics.record_tokens(r.request_id for r, got in zip(rows, sampled) for row in got if row.error is None)
        for request, row in ((r, row) for r, got in zip(rows, sampled) for row in got):
            if request.finished:
                continue  # (finished at an earlier token of its list)
            if row.error is not None:
                self._fail(request, row.error, "while sampling its next token")
                continue
            try:
                ending = self.scheduler.postprocess(request, row.token)
                finish, result = emit(request, row, ending, self.tokenizer, self.config.stream_interval)
            except Exception as exc:
                self._fail(request, exc, "while processing its output")
                continue
            if finish is not None:  # first, so a caller woken by its result sees it finished
                self._retire(request, answered=True)  # (the scheduler caches prompt + answer for a next turn)
            if result is not None:
                self._deliver(request, result)

    # -- leaving ------------------------------------------------------------------------

    def _retire(self, request: Request | EmbedRequest, answered: bool = False) -> None:
        """Finish a request in the scheduler (``answered``: its KV is kept for a next turn)
        and take it out of the metrics (the scheduler frees its blocks: nobody else's KV moves)."""
        self.scheduler.finish(request, answered)
        self.metrics.request_finished(request.request_id)
        if self.drafts is not None:
            self.drafts.forget(request)

    def _drop(self, request: Request) -> None:  # cancelled: its caller has gone, nothing is delivered
        self._retire(request)
        request.state = None

    def _deliver(self, request: Request, item: object) -> None:
        """Hand one result to the request's caller; a broken sink cancels the request."""
        try:
            request.sink.put(item)
        except Exception:
            logger.exception("could not deliver a result of request %s; cancelling it", request.request_id)
            request.cancelled = True

    def _fail(self, request: Request, exc: BaseException, during: str = "") -> None:
        """Fail one request alone. Errors that are not the package's own are logged and
        wrapped in :class:`RequestFailedError` (the cause chained), so callers always get
        an error they can catch as :class:`MLXParallmError`."""
        if not isinstance(exc, MLXParallmError):
            logger.error("request %s failed %s", request.request_id, during, exc_info=exc)
        exc = as_request_error(request.request_id, exc, during)
        self._retire(request)
        self._deliver(request, exc)

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
                self.metrics.request_finished(request.request_id)
                self._deliver(request, exc)
