"""The MLX side: one thread that owns the model, the batch's KV cache and the step loop.

Each step: take new arrivals, drop cancelled and timed-out rows, ask the scheduler for a
plan, prefill (a left-padded batch of new prompts and/or one chunk of a long prompt), then
run one decode step over every running row. Rows join the decode batch's
``BatchKVCache`` (mlx-lm) when their prefill ends and leave it the step they finish, so
their KV memory is freed at once.

Isolation: a fault while setting up, sampling, detokenising or delivering one request fails
that request alone (:class:`RequestFailedError`). Every request lives in the inbox or the
scheduler until it is retired, so when the model step fails and the worker dies, or a
shutdown outlasts its window (:mod:`.exit_guard`), every waiter gets :class:`EngineDeadError`.
Cancellations and deadlines are honoured between prefill pieces (one ``prefill_chunk_size``).

Paged KV (:mod:`.kv`, the default where the model allows): every row's KV lives in blocks
of one pool that the scheduler hands out; a step's forward pass reads each row's blocks
through its block table, so rows join and leave without moving anyone's KV, and a long row
costs only itself. Elsewhere, the rectangle: a left-padded mlx-lm ``BatchKVCache``.

Prefix caching (:mod:`.prefix_kv`): a request admitted with cached prompt tokens gets their
KV right after planning and computes only the rest; prompts (+ answers) go into the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import mlx.core as mx

from ..config import EngineConfig
from ..errors import EngineDeadError, MLXParallmError, RequestFailedError
from .detokenize import TextStream
from .exit_guard import register, wait_for_native_exit
from .guided import GrammarTokenizer
from .kv import KVCacheManager
from .kv.budget import pool_blocks
from .kv.paged_cache import PagedBatch
from .kv.storage import PagedKVStorage
from .kv.support import read_row, unsupported_reason, write_prefix
from .metrics import EngineMetrics
from .output import RowState, add_token
from .prefill import new_batch_cache, run_pieces, run_right_padded
from .prefix_cache import kv_range
from .prefix_kv import adopt_shared_prefixes, batch_cache_from_prefixes, can_share_kv, fetch_prefixes, make_prefix_cache, scheduler_prefix_options, store_rows
from .request import Request
from .sampling import RowSampler, SampledRow, sample_batch
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
        self.prefix_cache = make_prefix_cache(config)
        self.kv, self.storage = self._paged_kv(context_length)
        self.share_kv = self.kv is None and can_share_kv(model, config)
        budget = config.kv_cache_memory_bytes
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.prefill_chunk_size,
            None if budget is None else max(1, budget // self.kv_bytes_per_token),
            **scheduler_prefix_options(self.prefix_cache, config, self.kv_bytes_per_token),
            kv=self.kv,
        )
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.pad_id = next(iter(self.eos_ids), 0)
        self.grammar = GrammarTokenizer(tokenizer, vocab_size, self.eos_ids)
        self._inbox: deque[Request] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._stop_deadline: Optional[float] = None
        self.dead: Optional[BaseException] = None
        self.rows: list[Request] = []  # order of the decode cache's rows
        self.cache: Optional[list[Any]] = None
        self._thread = threading.Thread(target=self._run, name="mlx-parallm-worker", daemon=True)
        register(self)
        self._thread.start()

    def _paged_kv(self, context_length: int) -> tuple[Optional[KVCacheManager], Optional[PagedKVStorage]]:
        """The block pool and its arrays, or (None, None) where the model keeps the rectangle."""
        reason = unsupported_reason(self.model, self.config)
        if reason is not None:
            if self.config.kv_layout == "paged":
                logger.info("KV cache: the rectangle layout (%s)", reason)
            return None, None
        size = self.config.kv_block_size
        budget = self.config.kv_cache_memory_bytes
        blocks = pool_blocks(budget, self.kv_bytes_per_token, size, self.config.max_num_seqs * max(context_length, 1))
        return KVCacheManager(blocks, size), PagedKVStorage(len(self.model.layers), blocks, size, preallocate=budget is not None)

    def kv_stats(self) -> dict[str, Any]:
        """``stats()["kv_cache"]``: the layout, and for paged KV its blocks (total, free,
        used, usage = used / total), preemptions and the bytes its arrays hold."""
        if self.kv is None:
            return {"layout": "rectangle"}
        return {"layout": "paged", **self.kv.stats(), "kv_cache_bytes": self.storage.nbytes if self.storage else 0}

    def kv_usage(self) -> float:
        """KV memory in use, 0..1: used / total blocks for paged KV; for the rectangle, the
        admitted requests' prompt + max_tokens over the budget (or slots over
        ``max_num_seqs`` without one)."""
        if self.kv is not None:
            return self.kv.stats()["kv_cache_usage_perc"]
        scheduler = self.scheduler
        if scheduler.kv_budget_tokens:
            held = [*scheduler.running, *scheduler.prefilling, *([scheduler.chunking] if scheduler.chunking else [])]
            return sum(r.max_kv_tokens for r in held) / scheduler.kv_budget_tokens
        return self.num_running / scheduler.max_num_seqs

    # -- called from other threads ------------------------------------------------------

    def submit(self, request: Request) -> bool:
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
        with the step still computing (MLX cannot interrupt it), every request held fails
        with :class:`EngineDeadError` at once and the step ends in the background."""
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
        if self.kv is not None:
            self.storage.reserve(self.kv.pool.high_water())  # the blocks the plan hands out
            if len(plan.decode) != len(self.rows):  # preempted rows leave
                decoding = {id(r) for r in plan.decode}
                self.rows = [r for r in self.rows if id(r) in decoding]
        fetch_prefixes(self.prefix_cache, plan.admitted, lambda r, exc: self._fail(r, exc, "while fetching its cached prefix"))
        if plan.chunk is not None and not plan.chunk[0].finished:
            self._prefill_chunk(*plan.chunk)
            self._reap()
        prefill = [r for r in plan.prefill if not r.finished]
        if prefill:
            self._prefill(prefill)
            self._reap()
        if self.rows:
            self._decode()
        return True

    def _take_arrivals(self) -> bool:
        """Move new requests to the scheduler; block while there is nothing to do.
        Returns False when the worker should stop."""
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
            self._set_up(request)
        return True

    def _set_up(self, request: Request) -> None:
        """Give a new request its sampler and text stream; a fault fails it alone."""
        if request.cancelled:
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
        """Drop cancelled requests and fail those past their deadline, wherever they are."""
        now = self.clock()
        for request in self.scheduler.all_requests():
            if request.cancelled:
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
        """Prefill whole prompts (or what follows their cached prefix) as one batch and
        sample each first token.

        The batch runs in pieces of about ``prefill_chunk_size`` tokens in all; between
        pieces, cancelled and timed-out rows leave the batch, so they stop costing compute.
        """
        for r in requests:
            if not r.num_preemptions:
                self.metrics.request_admitted(r.request_id, r.prompt_len, cached_tokens=r.num_cached)
        piece = max(1, self.config.prefill_chunk_size // len(requests))
        if self.kv is not None:
            self._prefill_paged(requests, piece)
            return
        if any(r.num_cached for r in requests):
            cache = batch_cache_from_prefixes(len(self.model.layers), requests, self.share_kv, self.config.max_kv_size)
            rest = [r.prompt_ids[r.num_cached :] for r in requests]
            if len({len(x) for x in rest}) > 1:  # all but the last tokens, right-padded
                kept = run_right_padded(self.model, [x[:-1] for x in rest], cache, self.pad_id, piece, self._wanted(requests))
                if kept is None:
                    return
                requests, rest = [requests[i] for i in kept], [rest[i][-1:] for i in kept]
            tokens = mx.array(rest)
        else:
            longest = max(r.prompt_len for r in requests)
            padding = [longest - r.prompt_len for r in requests]
            tokens = mx.array([[self.pad_id] * p + r.prompt_ids for p, r in zip(padding, requests)])
            cache = new_batch_cache(len(self.model.layers), padding, self.config.max_kv_size, self.share_kv)
        ran = run_pieces(self.model, tokens, cache, piece, True, self._wanted(requests))
        if ran is None:
            return
        requests = [requests[i] for i in ran[0]]
        logits = self.model(ran[1], cache=cache)[:, -1, :]
        for r in requests:
            r.num_prefilled = r.prompt_len
        self._join_decode_batch(requests, cache, logits)

    def _prefill_chunk(self, request: Request, n: int) -> None:
        """Prefill the next ``n`` prompt tokens of a long prompt into its own cache."""
        state: RowState = request.state
        if self.kv is not None:
            self._prefill_chunk_paged(request, n)
            return
        if state.cache is None:
            self.metrics.request_admitted(request.request_id, request.prompt_len, cached_tokens=request.num_cached)
            layers = len(self.model.layers)
            share, size = self.share_kv, self.config.max_kv_size
            state.cache = batch_cache_from_prefixes(layers, [request], share, size) if request.num_cached else new_batch_cache(layers, [0], size, share)
        start = request.num_prefilled
        chunk = mx.array([request.prompt_ids[start : start + n]])
        logits = self.model(chunk, cache=state.cache)[:, -1, :]
        request.num_prefilled += n
        if request.num_prefilled < request.prompt_len:
            mx.eval([c.state for c in state.cache])
            return
        cache, state.cache = state.cache, None
        self._join_decode_batch([request], cache, logits)

    # -- paged KV -----------------------------------------------------------------------

    def _forward(self, rows: list[Request], pieces: list[list[int]], starts: list[int]) -> mx.array:
        """One forward pass of ``pieces[b]`` (tokens at ``starts[b]`` on) for each row, over
        the rows' blocks; returns the logits, ``(B, width, vocab)``."""
        assert self.kv is not None and self.storage is not None
        width = max(len(p) for p in pieces)
        self.storage.reserve(self.kv.pool.high_water())
        batch = PagedBatch(self.storage, [self.kv.table(id(r)) for r in rows], starts, [len(p) for p in pieces], width)
        tokens = mx.array([p + [self.pad_id] * (width - len(p)) for p in pieces])
        return self.model(tokens, cache=batch.layers())

    def _fill_cached_prefix(self, request: Request) -> None:
        """Copy the request's fetched prefix (``num_cached`` tokens) into its blocks."""
        prefix, request.state.prefix = request.state.prefix, None
        if prefix and request.num_cached:
            write_prefix(self.storage, self.kv, id(request), kv_range(prefix, 0, request.num_cached))

    def _eval_storage(self) -> None:
        mx.eval([a for a in (*self.storage.keys, *self.storage.values) if a is not None])

    def _prefill_paged(self, requests: list[Request], piece: int) -> None:
        """Prefill the rows' uncached tokens in right-padded pieces of ``piece`` columns,
        all but each row's last token; the last tokens go together in one column, whose
        logits give the first sampled tokens."""
        for r in requests:
            self._fill_cached_prefix(r)
        wanted = self._wanted(requests)
        seqs = {id(r): r.computed_ids for r in requests}
        while True:
            active = [r for r in requests if r.num_prefilled < len(seqs[id(r)]) - 1]
            if not active:
                break
            pieces = [seqs[id(r)][r.num_prefilled : min(r.num_prefilled + piece, len(seqs[id(r)]) - 1)] for r in active]
            self._forward(active, pieces, [r.num_prefilled for r in active])
            self._eval_storage()
            for r, p in zip(active, pieces):
                r.num_prefilled += len(p)
            flags = wanted()
            requests = [r for r, keep in zip(requests, flags) if keep]
            wanted = self._wanted(requests)
            if not requests:
                return
        logits = self._forward(requests, [seqs[id(r)][-1:] for r in requests], [r.num_prefilled for r in requests])[:, -1, :]
        for r in requests:
            r.num_prefilled = len(seqs[id(r)])
        self._join_decode_batch(requests, None, logits)

    def _prefill_chunk_paged(self, request: Request, n: int) -> None:
        """Prefill the next ``n`` tokens of a long prompt straight into its blocks."""
        if request.num_prefilled == request.num_cached:
            if not request.num_preemptions:
                self.metrics.request_admitted(request.request_id, request.prompt_len, cached_tokens=request.num_cached)
            self._fill_cached_prefix(request)
        seq = request.computed_ids
        start = request.num_prefilled
        logits = self._forward([request], [seq[start : start + n]], [start])[:, -1, :]
        request.num_prefilled += n
        if request.num_prefilled < len(seq):
            self._eval_storage()
            return
        self._join_decode_batch([request], None, logits)

    def _store_paged(self, requests: list[Request], sequences: list[list[int]], held: list[int]) -> None:
        """Put the first ``held[j]`` tokens of ``sequences[j]`` (row ``requests[j]``'s KV) into
        the prefix store; a failure is logged and costs nothing else."""
        if self.prefix_cache is None:
            return
        try:
            for r, seq, n in zip(requests, sequences, held):
                def source(a: int, b: int, r: Request = r) -> list[Any]:
                    return read_row(self.storage, self.kv, id(r), a, b)
                self.prefix_cache.insert(seq[:n], source, self.kv_bytes_per_token)
        except Exception:
            logger.exception("could not store KV in the prefix cache")

    def _join_decode_batch(self, requests: list[Request], cache: list[Any], logits: mx.array) -> None:
        sampled = self._sample(requests, logits)
        if self.kv is not None:
            seqs = [r.computed_ids for r in requests]
            self._store_paged(requests, seqs, [len(s) for s in seqs])
            self.rows.extend(requests)
            self.scheduler.started(requests)
            self._after_sampling(requests, sampled)
            return
        store_rows(self.prefix_cache, cache, [r.prompt_ids for r in requests], range(len(requests)), self.kv_bytes_per_token)
        if self.cache is None:
            self.cache = cache
        else:
            adopt_shared_prefixes(self.cache, [r.prompt_ids for r in self.rows], cache)
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        self.rows.extend(requests)
        self.scheduler.started(requests)
        self._after_sampling(requests, sampled)

    # -- decode -------------------------------------------------------------------------

    def _decode(self) -> None:
        tic = time.perf_counter()
        rows = list(self.rows)
        if self.kv is not None:
            logits = self._forward(rows, [[r.output_ids[-1]] for r in rows], [r.num_tokens - 1 for r in rows])[:, -1, :]
        else:
            tokens = mx.array([r.output_ids[-1] for r in rows])[:, None]
            logits = self.model(tokens, cache=self.cache)[:, -1, :]
        sampled = self._sample(rows, logits)
        self.metrics.record_step(len(rows), time.perf_counter() - tic)
        self._after_sampling(rows, sampled)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "decode step: batch=%d waiting=%d step_ms=%.1f",
                len(rows), self.scheduler.num_waiting, (time.perf_counter() - tic) * 1000,
            )

    def _sample(self, rows: list[Request], logits: mx.array) -> list[SampledRow]:
        samplers = [r.state.sampler for r in rows]
        contexts = [lambda r=r: mx.array(r.prompt_ids + r.output_ids) for r in rows]
        return sample_batch(logits, samplers, contexts)

    def _after_sampling(self, rows: list[Request], sampled: list[SampledRow]) -> None:
        self.metrics.record_tokens(r.request_id for r, row in zip(rows, sampled) if row.error is None)
        for request, row in zip(rows, sampled):
            if row.error is not None:
                self._fail(request, row.error, "while sampling its next token")
                continue
            try:
                finish, result = add_token(request, row, self.eos_ids, self.tokenizer)
            except Exception as exc:
                self._fail(request, exc, "while processing its output")
                continue
            if finish is not None:
                if self.kv is not None and any(r is request for r in self.rows):
                    # keep prompt + answer for a next turn; the last token has no KV yet
                    self._store_paged([request], [request.prompt_ids + request.output_ids], [request.num_tokens - 1])
                elif request in self.rows:  # keep prompt + answer for a next turn
                    seq = request.prompt_ids + request.output_ids
                    store_rows(self.prefix_cache, self.cache, [seq], [self.rows.index(request)], self.kv_bytes_per_token)
                self._retire(request)  # first, so a caller woken by its result sees it finished
            if result is not None:
                self._deliver(request, result)
        self._evict_finished()

    # -- leaving ------------------------------------------------------------------------

    def _evict_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if self.kv is not None:
            return  # the scheduler freed their blocks; nobody else's KV moves
        if not keep:
            self.cache = None
        else:
            for c in self.cache:
                c.filter(keep)

    def _retire(self, request: Request) -> None:
        """Mark a request finished and take it out of the scheduler and the metrics.
        Its decode row, if any, goes at the next :meth:`_evict_finished`."""
        request.finished = True
        self.scheduler.remove(request)
        self.metrics.request_finished(request.request_id)

    def _drop(self, request: Request) -> None:
        """Remove a cancelled request; its caller has gone, so nothing is delivered."""
        self._retire(request)
        self._evict_finished()
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
            cause = exc
            exc = RequestFailedError(f"request {request.request_id} failed {during}: {type(cause).__name__}: {cause}")
            exc.__cause__ = cause
        self._retire(request)
        self._deliver(request, exc)
        self._evict_finished()

    def _fail_all(self, exc: BaseException, from_outside: bool = False) -> None:
        """Fail every request held. ``from_outside``: by another thread during a step, so the
        lists stay as they are (requests marked finished; the worker's last call skips them)."""
        with self._cond:
            pending = list(self._inbox)
            self._inbox.clear()
            self._stopping = True
        held = self.scheduler.all_requests() if from_outside else self.scheduler.clear()
        for request in [*self.rows, *held, *pending]:
            if not request.finished:
                request.finished = True
                self.metrics.request_finished(request.request_id)
                self._deliver(request, exc)
        if not from_outside:
            self.rows, self.cache = [], None
