"""Scheduling policy: who is prefilled, who decodes, who waits. Pure bookkeeping, no MLX.

Each step (vLLM v1's shape, in miniature): every running request decodes one token; a long
prompt being prefilled in chunks gets its next chunk; waiting requests are admitted first
come, first served (one that does not fit blocks those behind it, so it is never starved)
while there is a free slot (``max_num_seqs``), KV room and step token budget
(``max_num_batched_tokens``, padding counted): short prompts together as one prefill batch,
a prompt longer than ``prefill_chunk_size`` (or the budget left) as a chunked prefill.

KV blocks (given a :class:`~.kv.KVCacheManager`): a request is admitted only when the pool
has free blocks for its prompt, given at once (a cached prefix as the cached blocks
themselves, shared); before each step every running row gets room for the token it
decodes, and when the pool runs out the newest running request is preempted (its blocks
freed, itself queued first to be recomputed from its prompt and output so far), as vLLM v1
does.

Embedding calls (:class:`~.embed.request.EmbedRequest`) take step token budget as prefills do, in
arrival order, but hold no slot and no KV; a call ends the step its last input is embedded.

Progress (nano-vllm's ``schedule -> run -> postprocess``, vLLM's ``update_from_output``): the
runner executes the plan (:mod:`.runner`); :meth:`Scheduler.update` records what it did: how
far each prompt is prefilled, each row's new tokens, whether a row ends (EOS, stop ids,
``max_tokens``, a stop string, its grammar's end: judged once, in :func:`.output.take_token`),
what its drafts came to, and each decoding row's drafts for the next step
(:mod:`.drafting`); :meth:`Scheduler.finish` frees a request's blocks (caching an answer's).

Decoding (:meth:`Scheduler._plan_decode`): a step verifies drafts when the drafting planner
says they pay, or is pipelined (:mod:`.decode_ahead`): rows whose tokens need only their logits
take the tokens computed ahead for them last step, and, when nothing else could be planned,
the next step is computed ahead too (KV room for its token held now).

Prefix sharing (``prefix_caching``): a request is admitted with the longest prefix of its
prompt the pool's cached blocks hold as ``num_cached`` (those blocks mapped into its table);
only the rest counts against the step budget. A waiting request that shares at least
``min_shared_tokens`` more tokens (or its whole prompt, for ``n > 1`` copies) with one being
prefilled waits for that prefill to end, so the prefix is computed once; requests behind it
that share nothing are admitted meanwhile.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable, Optional

from ..errors import MLXParallmError, as_request_error
from .embed.request import EmbedRequest, plan_embeddings
from .kv import KVCacheManager
from .kv.prefix_match import waits_for_sharer
from .output import record_prompt_logprobs, take_token
from .plan import StepOutput, StepPlan
from .request import Request
from .sampled import plain_row

logger = logging.getLogger(__name__)

Result = tuple[Any, object]
"""A result for a request's caller: (request, a Delta, Completion, EmbeddingResult or error)."""


class Scheduler:
    """Queues of waiting, prefilling and running requests, and the admission policy."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_size: int,
        kv: KVCacheManager,
        *,
        prefix_caching: bool = False,
        prefix_capacity_tokens: Optional[int] = None,
        min_shared_tokens: int = 64,
        eos_ids: Iterable[int] = (),
        drafting: Any = None,
        metrics: Any = None,
        tokenizer: Any = None,
        stream_interval: int = 1,
        decode_ahead: bool = False,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.prefix_caching = prefix_caching
        self.prefix_capacity_tokens = prefix_capacity_tokens
        self.min_shared_tokens = min_shared_tokens
        self.kv = kv
        self.eos_ids = frozenset(eos_ids)
        self.drafting = drafting  # a .drafting.Drafting, or None (no drafts)
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.decode_ahead = decode_ahead
        self._ahead: set[int] = set()  # the rows whose next step the runner computes ahead now
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted this step, prefilled as one batch
        self.chunking: Optional[Request] = None
        self.running: list[Request] = []
        self.embedding: deque[EmbedRequest] = deque()  # until every input has its vector

    # -- queues -----------------------------------------------------------------------

    def add(self, request: Request | EmbedRequest) -> None:
        """Queue a new request."""
        (self.embedding if isinstance(request, EmbedRequest) else self.waiting).append(request)

    def advanced(self, request: Request, n: int) -> None:
        """The chunk of ``n`` prompt tokens planned for ``request`` was prefilled."""
        request.num_prefilled += n

    def started(self, requests: Iterable[Request]) -> None:
        """Prefill finished for these requests (every token they hold is computed): they
        decode from the next step on, and their computed blocks go into the prefix store."""
        for request in requests:
            request.num_prefilled = request.num_tokens
            if request is self.chunking:
                self.chunking = None
            elif request in self.prefilling:
                self.prefilling.remove(request)
            self.running.append(request)
            self._cache_blocks(request, request.computed_ids, request.num_prefilled)

    def finish(self, request: Request | EmbedRequest, answered: bool = False) -> None:
        """Take a request out for good and free its KV blocks; ``answered``: its prompt + answer
        (but the last token, never computed) are named in the prefix store first."""
        request.finished = True
        if answered and isinstance(request, Request):
            self._cache_blocks(request, request.prompt_ids + request.output_ids, request.num_tokens - 1)
        self.remove(request)
        if isinstance(request, Request) and request.adapter is not None:
            request.adapter.release(len(request.output_ids))

    def retire(self, request: Request | EmbedRequest, answered: bool = False) -> None:
        """:meth:`finish` a request and forget it in the metrics and the drafting."""
        self.finish(request, answered)
        if self.metrics is not None:
            self.metrics.request_finished(request.request_id)
        if self.drafting is not None and isinstance(request, Request):
            self.drafting.forget(request)

    def fail(self, request: Request | EmbedRequest, exc: BaseException, during: str = "") -> Result:
        """Retire a request that failed alone; its caller's error. Errors that are not the
        package's own are logged and wrapped in :class:`~..errors.RequestFailedError` (the
        cause chained), so callers always get an error they can catch as ``MLXParallmError``."""
        if not isinstance(exc, MLXParallmError):
            logger.error("request %s failed %s", request.request_id, during, exc_info=exc)
        self.retire(request)
        return request, as_request_error(request.request_id, exc, during)

    def update(self, plan: StepPlan, out: StepOutput) -> list[Result]:
        """Record what the runner did with ``plan``; returns what each request's caller gets
        now, in order (a request finished here is retired first, so a caller woken by its
        result sees it finished)."""
        results = [self.fail(request, exc, during) for request, exc, during in out.failed if not request.finished]
        self.kv.arrays_hold(out.physical_blocks)
        if out.saved:
            self.kv.disk.to_disk(out.saved)
        for request, first, scores in out.prompt_logprobs:
            record_prompt_logprobs(request, first, scores, self.tokenizer)
        if out.chunked is not None:
            self.advanced(*out.chunked)
        self.started(out.prefilled)
        decoded = out.decoded
        if decoded:
            self._ahead = {id(r) for r in out.ahead}
            if self.metrics is not None:
                self.metrics.record_step(len(decoded), out.decode_seconds)
            if self.drafting is not None:  # what a step of this width costs, for its next plan
                self.drafting.verified(decoded, plan.verify, out, plan.pipelined)
        if self.metrics is not None:
            self.metrics.record_tokens(r.request_id for r, rows in out.sampled for row in rows if row.error is None)
        for request, rows in out.sampled:
            results.extend(self._take(request, rows))
        for request in out.embedded:
            if not request.finished:
                self.retire(request)
                results.append((request, request.result()))
        if self.drafting is not None and (decoded or out.prefilled):  # before the next plan, which makes room for them
            self.drafting.draft_all([r for r in [*decoded, *out.prefilled] if not r.finished])
        return results

    def _take(self, request: Request, rows: list[Any]) -> list[Result]:
        """Take a row's new tokens in order (accepted drafts, then the one it sampled)."""
        results: list[Result] = []
        for row in rows:
            if request.finished:
                break  # (finished at an earlier token of its list)
            if row.error is not None:
                results.append(self.fail(request, row.error, "while sampling its next token"))
                break
            try:
                finish, result = take_token(request, row, self.eos_ids, self.tokenizer, self.stream_interval)
            except Exception as exc:
                results.append(self.fail(request, exc, "while processing its output"))
                break
            if finish is not None:  # first, so a caller woken by its result sees it finished
                self.retire(request, answered=True)  # (its prompt + answer are cached for a next turn)
            if result is not None:
                results.append((request, result))
        return results

    def _reserve_ahead(self, rows: list[Request]) -> bool:
        """Give ``rows`` room for one more token before this step's tokens are known, so
        the runner may decode them once more ahead (:mod:`.decode_ahead`); False (nothing
        given) while anything else could be planned (a prompt with a free slot, a chunk, an
        embedding), or the pool is short. (Nothing slides out of a window here: this step's
        query still reads the oldest block of its window; the next plan slides.)"""
        admissible = self.waiting and self.num_running < self.max_num_seqs
        if admissible or self.prefilling or self.chunking is not None or self.embedding:
            return False
        return self.kv.hold({id(r): r.num_tokens + 1 for r in rows})

    def _cache_blocks(self, request: Request, tokens: list[int], computed: int) -> None:  # for later prompts to share
        if self.prefix_caching:
            self.kv.register(id(request), tokens, computed, request.cache_namespace)

    def remove(self, request: Request | EmbedRequest) -> None:
        """Drop a request wherever it is and free its KV blocks (see :meth:`finish`)."""
        if not isinstance(request, EmbedRequest):
            self.kv.free(id(request))
        if request is self.chunking:
            self.chunking = None
        else:
            for queue in (self.running, self.prefilling, self.waiting, self.embedding):
                if request in queue:
                    queue.remove(request)  # type: ignore[arg-type]
                    break

    def all_requests(self) -> list[Request | EmbedRequest]:
        """Every request the scheduler holds."""
        chunking = [self.chunking] if self.chunking is not None else []
        return [*self.running, *self.prefilling, *chunking, *self.waiting, *self.embedding]

    def clear(self) -> list[Request | EmbedRequest]:
        """Forget every request (the worker is going away); returns them."""
        requests = self.all_requests()
        for request in requests:
            self.kv.free(id(request))
        self.waiting.clear()
        self.embedding.clear()
        self.prefilling.clear()
        self.chunking = None
        self.running.clear()
        return requests

    @property
    def num_running(self) -> int:
        """Requests holding a batch slot (decoding or being prefilled)."""
        return len(self.running) + len(self.prefilling) + (self.chunking is not None)

    @property
    def num_waiting(self) -> int:
        """Requests queued: prompts not yet admitted and embedding calls not yet answered."""
        return len(self.waiting) + len(self.embedding)

    def fits_alone(self, request: Request) -> bool:
        """Whether the request could ever be admitted: its blocks fit the whole pool."""
        return self.kv.fits_request(request.num_tokens, request.max_kv_tokens)

    def kv_usage(self) -> float:
        """KV memory in use, 0..1: used / total blocks."""
        return self.kv.stats()["kv_cache_usage_perc"]

    # -- policy -----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step."""
        self._make_room_to_decode()
        plan = StepPlan(decode=list(self.running))
        budget = self.max_num_batched_tokens - len(plan.decode)
        if self.chunking is not None and budget > 0:
            remaining = self.chunking.num_tokens - self.chunking.num_prefilled
            n = min(self.prefill_chunk_size, remaining, budget)
            plan.chunk = (self.chunking, n)
            budget -= n
        # Embedding inputs that arrived before the first waiting prompt go first; later ones
        # take what the prompts leave (they hold no slot or KV, so they never wait for one).
        budget = plan_embeddings(self.embedding, plan, budget, self.waiting[0].arrival if self.waiting else None)

        slots = self.max_num_seqs - self.num_running
        longest = 0  # longest uncached prompt part in plan.prefill
        # Requests whose prompt KV will be in the prefix store once their prefill ends.
        sharers = [*self.prefilling, *([self.chunking] if self.chunking is not None else [])]
        deferred: list[Request] = []
        while self.waiting and slots > 0 and budget > 0:
            request = self.waiting[0]
            # The cache is the pool's blocks, looked up once (a preempted request by its
            # prompt + output too); at least one token is computed, for the logits.
            shares = self.prefix_caching and request.reads_cached_prefix
            if shares and self.kv.disk is not None and request.cache_namespace == 0:  # what the pool lacks, from disk
                self.kv.disk.load_prefix(self.kv, request.computed_ids, request.num_tokens - 1)
            prefix = self.kv.match(request.computed_ids, request.num_tokens - 1, request.cache_namespace) if shares else None
            cached = prefix.tokens if prefix is not None else 0
            # Its prompt and the token it decodes the step its prefill ends, with a block of
            # headroom while others hold blocks; alone, its own blocks always fit (fits_alone).
            busy = self.num_running > 0
            # Sliding-window layers get blocks only up to its first chunk (the whole prompt if short).
            window_end = self._chunk_end(request, cached)
            if self.kv.admission_cost(request.num_tokens + 1, prefix, window_end) + busy > self.kv.num_free:
                if busy:
                    break
                prefix, cached = None, 0
                window_end = self._chunk_end(request, 0)
            if shares and waits_for_sharer(request, cached, sharers, self.min_shared_tokens, self.prefix_capacity_tokens, self.kv.reusable):
                deferred.append(self.waiting.popleft())
                continue
            uncached = request.num_tokens - cached
            padded_cost = (len(plan.prefill) + 1) * max(longest, uncached)
            if uncached <= self.prefill_chunk_size and padded_cost <= budget:
                plan.prefill.append(request)
                self.prefilling.append(request)
                longest = max(longest, uncached)
            elif self.chunking is None and not plan.prefill:
                self.chunking = request
                n = min(self.prefill_chunk_size, uncached, budget)
                plan.chunk = (request, n)
                budget -= n
            else:
                break
            request.num_cached = request.num_prefilled = cached
            self.kv.grow(id(request), request.num_tokens + 1, prefix, limit=request.max_kv_tokens, window_end=window_end)
            self.kv.slide(id(request), request.num_cached)  # (a long cached prefix: only its window is held)
            self.waiting.popleft()
            sharers.append(request)
            slots -= 1
        self.waiting.extendleft(reversed(deferred))
        plan_embeddings(self.embedding, plan, budget - len(plan.prefill) * longest)
        self._admitted(plan)
        if plan.decode:
            self._plan_decode(plan)
        plan.kv = self.kv.for_step([id(r) for r in [*plan.decode, *plan.admitted]])
        return plan

    def _admitted(self, plan: StepPlan) -> None:
        """Tell the metrics which requests start their prefill this step (not recomputed ones)."""
        if self.metrics is None:
            return
        starting = list(plan.prefill)
        if plan.chunk is not None and plan.chunk[0].num_prefilled == plan.chunk[0].num_cached:
            starting.append(plan.chunk[0])  # its first chunk
        for r in starting:
            if not r.num_preemptions:
                self.metrics.request_admitted(r.request_id, r.prompt_len, cached_tokens=r.num_cached)

    def _plan_decode(self, plan: StepPlan) -> None:
        """How the decode rows run: verifying drafts, pipelined (taking what was computed ahead
        for them, and computing the next step ahead where nothing else could be planned), or plain."""
        rows = plan.decode
        would_verify = self.drafting.would_verify if self.drafting is not None else (lambda rows: False)
        covered = [r for r in rows if id(r) in self._ahead]
        plan.pipelined = self.decode_ahead and all(plain_row(r) for r in rows) and bool(covered or not would_verify(rows))
        if not plan.pipelined:
            plan.verify = self.drafting.plan(rows) if self.drafting is not None else None
            return
        plan.decode = rows = [*covered, *(r for r in rows if id(r) not in self._ahead)]  # the order the runner takes them in
        going = [r for r in rows if len(r.output_ids) + 1 < r.params.max_tokens]  # the rest may end this step
        if going and not would_verify(going) and self._reserve_ahead(going):
            plan.ahead = going

    def _make_room_to_decode(self) -> None:
        """Give every running row a slot for the token it decodes this step (and for its
        speculative drafts), dropping drafts first, then preempting the newest requests
        (running, else the one being chunk-prefilled) while the pool has too few free blocks."""
        while True:
            for r in [*self.running, *([self.chunking] if self.chunking is not None else [])]:
                self.kv.slide(id(r), r.num_prefilled if r is self.chunking else r.num_tokens - 1)  # its next query's window
            wanted = {id(r): r.num_tokens + len(r.draft) for r in self.running}
            ends = {}
            if self.chunking is not None:  # its next chunk's blocks in sliding-window layers
                c = self.chunking
                wanted[id(c)] = c.num_tokens + 1
                ends[id(c)] = self._chunk_end(c, c.num_prefilled)
            if self.kv.hold(wanted, ends):
                return
            if any(r.draft for r in self.running):
                for r in self.running:
                    r.draft = []
                continue
            if self.chunking is not None:
                victim, self.chunking = self.chunking, None
                held = victim.num_prefilled
            elif len(self.running) > 1:
                victim = self.running.pop()
                held = victim.num_tokens - 1  # its last sampled token has no KV yet
            else:  # pragma: no cover - fits_alone() holds every request to the whole pool
                raise RuntimeError("one request needs more KV blocks than the pool has")
            self._cache_blocks(victim, victim.computed_ids, held)  # findable until the blocks are needed
            self.kv.preempted(id(victim))
            victim.num_preemptions += 1
            victim.num_prefilled = victim.num_cached = 0
            victim.draft = []
            self.waiting.appendleft(victim)

    def _chunk_end(self, request: Request, start: int) -> int:
        """The entries ``request``'s sliding-window layers need when its prefill goes on from
        ``start``: up to the end of that chunk at most, and the token it then decodes."""
        return start + min(self.prefill_chunk_size, request.num_tokens - start) + 1
