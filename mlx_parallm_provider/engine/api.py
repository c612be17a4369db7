"""The caller's side of the engine: submit, results back to the caller's loop or thread,
cancellation, the sync bridge and stats.

Any number of event loops and plain threads may call one :class:`Engine` at once; every
request goes to the same core, so they all land in the same batch. Results are handed
back with ``loop.call_soon_threadsafe`` (async callers) or a thread-safe queue (sync callers).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any, AsyncGenerator, Generator, Optional, Union

from .._validation import check_text
from ..config import EngineConfig
from ..errors import ContextWindowExceededError, EngineOverloadedError, InvalidParameterError
from ..models import backends, registry
from ..models.registry import LoadedModel
from .adapters import EngineAdapters, LoRAMethods
from .core import EngineCore
from .embed.api import EmbedMethods
from .fanout import POLL_S, FanOut, TaggedSink, expand
from .grammar.probe import build_off_loop
from .metrics import EngineMetrics, prefix_stats
from .prompt_size import PromptEncoder
from .request import Completion, Delta, Prompt, Request, ResultSink, SamplingParams
from .sinks import LoopSink as _LoopSink
from .sinks import ThreadSink as _ThreadSink
from .sleep import SleepMethods
from .token_bans import bad_word_ids

logger = logging.getLogger(__name__)


class Engine(EmbedMethods, SleepMethods, LoRAMethods):
    """One loaded model served to any number of concurrent callers, batched.

    Use :func:`mlx_parallm_provider.get_engine` to share one engine per model per process.
    Besides generation it embeds texts (:meth:`embed`, :meth:`embed_sync`; see :mod:`.embed.api`),
    serves LoRA adapters per request (``SamplingParams(lora=...)``, :meth:`add_lora`; see
    :mod:`.adapters`); :meth:`sleep` frees its weights and KV, :meth:`wake` (or the next request)
    loads them again (:mod:`.sleep`).

    Args:
        model: a model name for :func:`mlx_parallm_provider.models.registry.load`
            (``"default"``, a ``.gguf`` path, a folder or a repo id).
        config: engine settings; defaults to :meth:`EngineConfig.from_env`; its ``device`` sets
            up the model loaded (a ``loaded`` model keeps its backend where it has one).
        loaded: an already loaded model (then ``model`` is only its display name).
    """

    def __init__(self, model: str = "default", config: Optional[EngineConfig] = None, *, loaded: Optional[LoadedModel] = None) -> None:
        self.config = config or EngineConfig.from_env()
        self.model_name = model
        self._reloadable = loaded is None
        self._adapters = EngineAdapters(None, self.config.max_loras)  # (its model: the one adopted, None asleep)
        self._adopt(loaded or registry.load(model, dequantize=self.config.dequantize, device=self.config.device))
        assert self._loaded is not None
        self.tokenizer = self._loaded.tokenizer  # (kept while asleep: the same files load the same tokenizer)
        self.context_length = self._loaded.context_length
        self.vocab_size = int(self._loaded.config.get("vocab_size", 0)) or None
        self._prompts = PromptEncoder(self.encode, self.tokenizer, self.context_length)
        self.metrics = EngineMetrics()
        self._core_lock = threading.Lock()
        self._core: Optional[EngineCore] = None
        self._ids = itertools.count()
        _live_engines.add(self)

    # -- public API ---------------------------------------------------------------------

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Completion:
        """Generate a whole completion. Cancelling the awaiting task cancels the request."""
        sink = _LoopSink()
        prompt = await self._prompts.tokenized_off_loop(prompt, params)
        await self._grammars_built_off_loop([params])
        request = self._submit(prompt, params, request_id, sink, stream=False)
        sink.request = request
        return await self._result(sink, request)

    async def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> AsyncGenerator[Delta, None]:
        """Yield :class:`Delta` pieces as they are generated; breaking out cancels."""
        sink = _LoopSink()
        prompt = await self._prompts.tokenized_off_loop(prompt, params)
        await self._grammars_built_off_loop([params])
        request = self._submit(prompt, params, request_id, sink, stream=True)
        sink.request = request
        try:
            while True:
                item = await self._next_item(sink, request)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not request.finished:
                self._cancel(request)

    def generate_sync(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Completion:
        """Blocking :meth:`generate`, for plain threads (not inside a running event loop's thread)."""
        sink = _ThreadSink()
        request = self._submit(prompt, params, request_id, sink, stream=False)
        return self._result_sync(sink, request)

    def stream_sync(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Generator[Delta, None, None]:
        """Blocking :meth:`stream`, for plain threads; closing the iterator cancels."""
        sink = _ThreadSink()
        request = self._submit(prompt, params, request_id, sink, stream=True)
        try:
            while True:
                item = self._next_item_sync(sink, request)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not request.finished:
                self._cancel(request)

    async def generate_many(
        self,
        prompts: Sequence[Prompt],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        n: int = 1,
        request_id: Optional[str] = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Generate ``n`` completions for each prompt, all submitted at once.

        Results come prompt by prompt (``n`` for the first prompt, then the next).
        ``params`` is one :class:`SamplingParams` or one per prompt; choice ``i`` of a
        seeded request uses ``seed + i``. A call larger than the waiting queue
        (``EngineConfig.max_queue``) is submitted in waves as room frees up. When one
        request fails, the others are cancelled and its error raised, unless
        ``return_exceptions`` (then each failure takes its place in the list).
        Cancelling the awaiting task cancels every request.
        """
        jobs = await self._prompts.jobs_tokenized_off_loop(expand(prompts, params, n))
        await self._grammars_built_off_loop([s for _, s in jobs])
        run = FanOut(self, jobs, request_id, return_exceptions)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                run.cancel()

        try:
            while True:
                run.submit_ready(lambda index: TaggedSink(put, index, loop.is_closed, loop, inbox.put_nowait))
                if run.done:
                    return run.results
                if run.waiting_for_room:  # poll (no wait_for: it can drop a result it cancels)
                    try:
                        index, item = inbox.get_nowait()
                    except asyncio.QueueEmpty:
                        await asyncio.sleep(POLL_S)
                        continue
                else:
                    index, item = await inbox.get()
                run.deliver(index, item)
        except BaseException:
            run.cancel()
            raise

    def generate_many_sync(
        self,
        prompts: Sequence[Prompt],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        n: int = 1,
        request_id: Optional[str] = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Blocking :meth:`generate_many`: submits every request from the calling thread
        (no thread per request) and waits for all of them."""
        run = FanOut(self, expand(prompts, params, n), request_id, return_exceptions)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        try:
            while True:
                run.submit_ready(lambda index: TaggedSink(inbox.put, index))
                if run.done:
                    return run.results
                try:
                    index, item = inbox.get(timeout=POLL_S if run.waiting_for_room else None)
                except queue.Empty:
                    continue
                run.deliver(index, item)
        except BaseException:
            run.cancel()
            raise

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, as the engine will feed them to the model.

        Text gets the tokenizer's special tokens (e.g. BOS) unless it already starts with
        the BOS token, as in ``mlx_lm.generate``; a list of ids is checked and used as is.
        """
        if isinstance(prompt, str):
            check_text("prompt", prompt)  # a lone surrogate: tokenizers raise a bare TypeError
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special = bos is None or not prompt.startswith(bos)
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special))
        if not isinstance(prompt, (list, tuple)):
            raise InvalidParameterError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        for i, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (self.vocab_size and token >= self.vocab_size):
                raise InvalidParameterError(f"prompt[{i}]", f"{token!r} is not a token id of this model (0..{(self.vocab_size or 0) - 1})")
        return list(prompt)

    def stats(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict: requests running / waiting / finished, token counts, the largest decode
        batch seen, tokens/s over the last minute, p50/p99 of TTFT, TPOT, ITL and queue time (seconds),
        ``prefix_cache`` (hit rate, cached tokens and bytes, evictions), ``kv_cache`` (blocks total / free / used,
        ``kv_cache_usage_perc``, preemptions, bytes), ``kv_disk`` (the disk tier's hits, bytes, evictions, skipped
        files), ``kv_tiers`` (each prefix store tier's hit tokens, bytes, evictions), ``speculation`` (n-gram drafts) and
        ``fast_forward`` (grammar-forced tokens): None when off; ``backend`` (the model's backend: "cpu", "gpu",
        "mlx") and ``attention`` (how it reads the paged KV, e.g. "paged kernels (cuda)", or "gather (...)" with
        why); ``decode`` (how its decode steps' forward runs: "compiled", or "uncompiled (...)" with
        why; None before the first); ``state`` ("awake" / "asleep") and ``memory_bytes`` (:meth:`memory_bytes`)."""
        core = self._core
        running, waiting = (core.num_running, core.num_waiting) if core is not None and core.alive else (0, 0)
        snap = self.metrics.snapshot(running=running, waiting=waiting)
        snap["model"], snap["state"], snap["memory_bytes"] = self.model_name, self.state, self.memory_bytes()
        snap["prefix_cache"] = prefix_stats(self.config.enable_prefix_caching, core.prefix_store_stats() if core is not None else None, snap)
        snap.update(core.memory_stats(snap["cached_prompt_tokens"]) if core is not None else {"kv_cache": {"layout": "paged"}, "kv_disk": None, "kv_tiers": {}})
        snap.update(core.drafting_stats() if core is not None else {"speculation": None, "fast_forward": None})
        loaded = self._loaded
        snap.update(backends.describe(loaded.model) if loaded is not None else {"backend": None, "attention": None})
        snap["decode"] = core.runner.decode_path() if core is not None else None
        snap["lora"] = self._adapters.stats()
        return snap

    def shutdown(self) -> None:
        """Stop the worker thread; requests still in flight fail with EngineDeadError."""
        with self._core_lock:
            core, self._core = self._core, None
        if core is not None:
            core.stop()

    # -- internals --------------------------------------------------------------------

    async def _result(self, sink: _LoopSink, request: Any) -> Any:
        """A request's one result (a completion, an embedding), its error raised; the
        request is cancelled if the wait is interrupted."""
        try:
            item = await self._next_item(sink, request)
        except BaseException:
            self._cancel(request)
            raise
        if isinstance(item, BaseException):
            raise item
        return item

    def _result_sync(self, sink: _ThreadSink, request: Any) -> Any:
        """Blocking :meth:`_result`."""
        try:
            item = self._next_item_sync(sink, request)
        except BaseException:
            self._cancel(request)
            raise
        if isinstance(item, BaseException):
            raise item
        return item

    async def _next_item(self, sink: _LoopSink, request: Request) -> object:
        """The request's next result; at its deadline, a timeout error, whatever the worker
        is busy with (a long prefill step must not delay the caller's timeout)."""
        left = request.time_left(time.monotonic())
        if left is None:
            return await sink.queue.get()
        try:
            if left <= 0:
                return sink.queue.get_nowait()
            return await asyncio.wait_for(sink.queue.get(), left)
        except (asyncio.TimeoutError, asyncio.QueueEmpty):
            self._cancel(request)
            return request.timeout_error()

    def _next_item_sync(self, sink: _ThreadSink, request: Request) -> object:
        """Blocking :meth:`_next_item`."""
        left = request.time_left(time.monotonic())
        try:
            return sink.queue.get(timeout=None if left is None else max(0.0, left))
        except queue.Empty:
            self._cancel(request)
            return request.timeout_error()

    async def _grammars_built_off_loop(self, params: Sequence[Any]) -> None:
        """New constraints' grammars built and probed on a thread (:func:`.grammar_probe.build_off_loop`)."""
        if any(isinstance(p, SamplingParams) and p.constraint is not None for p in params):
            await build_off_loop(self._live_core().grammar, params)

    def _submit(self, prompt: Prompt, params: Optional[SamplingParams], request_id: Optional[str], sink: ResultSink, stream: bool) -> Request:
        with self._submission():  # (counted in flight, so not put to sleep, and awake: :mod:`.sleep`)
            return self._submit_awake(prompt, params, request_id, sink, stream)

    def _submit_awake(self, prompt: Prompt, params: Optional[SamplingParams], request_id: Optional[str], sink: ResultSink, stream: bool) -> Request:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidParameterError("params", f"must be a SamplingParams, got {type(params).__name__}")
        ids = self._prompts.encode_within_context(prompt, params.max_tokens, params.truncate_prompt_tokens)
        if not ids:
            raise InvalidParameterError("prompt", "is empty")
        if self.vocab_size:
            params.check_vocabulary(self.vocab_size)
        if len(ids) + params.max_tokens > self.context_length:
            raise ContextWindowExceededError(len(ids), params.max_tokens, self.context_length)
        timeout = params.timeout if params.timeout is not None else self.config.request_timeout_s
        now = time.monotonic()
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            prompt_ids=ids, params=params, sink=sink, stream=stream, arrival=now,
            deadline=None if timeout is None else now + timeout,
            bad_word_ids=bad_word_ids(self.tokenizer, params.bad_words),  # (raises before the adapter below is taken)
            predicted_ids=self._prompts.prediction_ids(params.prediction),
            adapter=self._adapters.acquire(params.lora),
        )
        try:
            return self._submit_to_core(request)
        except BaseException:
            if request.adapter is not None:
                request.adapter.release()
            raise

    def _submit_to_core(self, request: Request) -> Request:
        ids, params = request.prompt_ids, request.params
        for _ in range(2):
            core = self._live_core()
            if params.constraint is not None:  # one that fails within a few tokens is a 400 here
                core.grammar.check(params.constraint.grammar())
            if not core.scheduler.fits_alone(request):
                budget = self.config.kv_cache_memory_gb
                raise InvalidParameterError(
                    "max_tokens",
                    f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) needs {request.max_kv_tokens} tokens "
                    f"({request.max_kv_tokens * self._kv_bytes_per_token / 1024**2:.3g} MiB) of KV cache, more than "
                    f"the engine's whole KV pool holds ({core.kv.capacity_tokens} tokens; kv_cache_memory_gb={budget})",
                )
            if core.num_waiting >= self.config.max_queue:
                raise EngineOverloadedError(
                    f"{core.num_waiting} requests are already waiting (max_queue={self.config.max_queue}); "
                    "retry later or raise EngineConfig.max_queue"
                )
            self.metrics.request_arrived(request.request_id)
            if core.submit(request):
                return request
        raise RuntimeError("could not start the engine's core")  # pragma: no cover

    def _queue_room(self) -> int:
        """How many more requests the waiting queue takes now."""
        core = self._core
        waiting = core.num_waiting if core is not None and core.alive else 0
        return self.config.max_queue - waiting

    def _live_core(self) -> EngineCore:
        """The running core, started where there is none (the engine woken first where asleep)."""
        while True:
            while self._loaded is None:
                self.wake()
            core = self._live_core_awake()
            if core is not None:
                return core

    def _live_core_awake(self) -> Optional[EngineCore]:
        with self._core_lock:
            if self._loaded is None:  # put to sleep meanwhile
                return None
            if self._core is None or not self._core.alive:
                if self._core is not None:
                    logger.warning("starting a fresh core after: %s", self._core.dead)
                self._core = EngineCore(self._loaded.model, self.tokenizer, self.config, self.metrics, self._kv_bytes_per_token, vocab_size=self.vocab_size
                                        or 0, context_length=self.context_length, model_path=getattr(self._loaded, "path", None))
            return self._core

    def _cancel(self, request: Request) -> None:
        request.cancelled = True
        core = self._core
        if core is not None:
            core.wake()


_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()

