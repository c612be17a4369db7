"""Continuous batching on one llama.cpp context through llama-cpp-python's low-level API, as
llama.cpp's own ``parallel`` example and ``llama-server`` do it.

One context holds up to ``n_seq_max`` sequences (one per request, its ``seq_id``). Each step
is one ``llama_decode`` of a batch holding the next token of every running sequence plus the
whole prompts of the requests admitted at that step (so requests arriving together are
prefilled together, and a request waiting for a free sequence joins as soon as one finishes).
Each sequence has its own sampler (greedy at temperature 0). A sequence leaves when it
samples an end-of-generation token (``llama_vocab_is_eog``, not counted as output; unless EOS
is ignored) or reaches its token budget, and its KV cells are freed for the next request.

``lib`` is the ``llama_cpp`` module (or a fake of it in tests); nothing here imports it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .base import Sampling


class LlamaDecodeError(RuntimeError):
    """``llama_decode`` failed; the requests of that batch fail with it."""

    kind = "llama_decode"


@dataclass
class Job:
    """One request: its prompt token ids and budget, and how it reports back (from the
    scheduler's thread): ``on_token(token_id)`` per new output token, ``on_done(error)`` once."""

    prompt: Sequence[int]
    max_tokens: int
    on_token: Callable[[int], None]
    on_done: Callable[[Optional[BaseException]], None]


@dataclass
class _Slot:
    job: Job
    seq_id: int
    sampler: Any
    n_past: int = 0
    generated: int = 0
    last: int = -1
    out_index: int = -1  # where this sequence's logits are in the current batch


class BatchScheduler:
    """Runs :class:`Job` s on one context, many sequences per ``llama_decode``.

    ``n_ctx_seq`` is the most positions one sequence may use (the model's training context):
    a prompt that leaves no room fails, and generation stops there.
    """

    def __init__(self, lib: Any, ctx: Any, vocab: Any, *, n_seq_max: int, n_batch: int, n_ctx_seq: int,
                 sampling: Sampling = Sampling(), ignore_eos: bool = False, seed: int = 0) -> None:
        self.lib, self.ctx, self.vocab = lib, ctx, vocab
        self.n_seq_max, self.n_batch, self.n_ctx_seq = n_seq_max, n_batch, n_ctx_seq
        self.sampling, self.ignore_eos, self.seed = sampling, ignore_eos, seed
        self.memory = lib.llama_get_memory(ctx)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.pending: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.waiting: list[Job] = []  # taken from the queue, no free sequence yet
        self.running: list[_Slot] = []
        self.free_ids = list(range(n_seq_max))
        self.max_decode_batch = 0  # most sequences in one llama_decode
        self._stopped = False

    # -- called from any thread ---------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a request; it joins the next step with a free sequence."""
        self.pending.put(job)

    def stop(self) -> None:
        """End :meth:`serve` (after failing what is still queued or running)."""
        self.pending.put(None)

    # -- the scheduler's thread ---------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a request is running or waiting for a sequence."""
        return bool(self.running or self.waiting)

    def serve(self) -> None:
        """Step until :meth:`stop`; blocks on the queue while idle."""
        while not self._stopped:
            self._take(block=not self.busy)
            try:
                self.step()
            except Exception as exc:  # a bug or a broken context: fail the requests, never hang them
                self._fail_all(exc)
        self._fail_all(RuntimeError("llama.cpp runner stopped"))

    def _fail_all(self, error: BaseException) -> None:
        for slot in list(self.running):
            with contextlib.suppress(Exception):
                self._finish(slot, error)
        for job in self.waiting:
            job.on_done(error)
        self.waiting.clear()

    def close(self) -> None:
        """Free the batch (after :meth:`serve` has returned)."""
        self.lib.llama_batch_free(self.batch)

    def _take(self, block: bool) -> None:
        try:
            item = self.pending.get(block=block)
            while True:
                if item is None:
                    self._stopped = True
                else:
                    self.waiting.append(item)
                item = self.pending.get_nowait()
        except queue.Empty:
            pass

    def step(self) -> None:
        """Take what was submitted, then one ``llama_decode``: the running sequences' next
        tokens and the prompts admitted now (nothing when idle or stopped)."""
        self._take(block=False)
        if self._stopped:
            return
        n = 0
        for slot in self.running:
            n = self._add(n, slot, [slot.last], slot.n_past)
        admitted = self._admit(n)
        for slot in admitted:
            n = self._add(n, slot, slot.job.prompt, 0)
        self.running.extend(admitted)
        if n == 0:
            return
        self.batch.n_tokens = n
        self.max_decode_batch = max(self.max_decode_batch, len(self.running))
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            error = LlamaDecodeError(f"llama_decode returned {rc} for {n} tokens of {len(self.running)} sequences")
            for slot in list(self.running):
                self._finish(slot, error)
            return
        for slot in list(self.running):
            self._sampled(slot, self.lib.llama_sampler_sample(slot.sampler, self.ctx, slot.out_index))

    def _admit(self, n: int) -> list[_Slot]:
        """Waiting jobs that get a free sequence and fit in the batch, in arrival order."""
        admitted: list[_Slot] = []
        while self.waiting and self.free_ids:
            job = self.waiting[0]
            if not job.prompt or len(job.prompt) > min(self.n_batch, self.n_ctx_seq):
                self.waiting.pop(0)
                job.on_done(ValueError(f"prompt of {len(job.prompt)} tokens does not fit llama.cpp's batch/context"))
                continue
            if n + len(job.prompt) > self.n_batch:
                break  # next step
            self.waiting.pop(0)
            admitted.append(_Slot(job, self.free_ids.pop(0), self._sampler()))
            n += len(job.prompt)
        return admitted

    def _add(self, n: int, slot: _Slot, tokens: Sequence[int], first_pos: int) -> int:
        b = self.batch
        for j, token in enumerate(tokens):
            b.token[n + j] = token
            b.pos[n + j] = first_pos + j
            b.n_seq_id[n + j] = 1
            b.seq_id[n + j][0] = slot.seq_id
            b.logits[n + j] = j == len(tokens) - 1
        slot.n_past = first_pos + len(tokens)
        slot.out_index = n + len(tokens) - 1
        return n + len(tokens)

    def _sampled(self, slot: _Slot, token: int) -> None:
        if not self.ignore_eos and self.lib.llama_vocab_is_eog(self.vocab, token):
            self._finish(slot, None)
            return
        slot.generated += 1
        slot.last = token
        slot.job.on_token(token)
        if slot.generated >= slot.job.max_tokens or slot.n_past >= self.n_ctx_seq:
            self._finish(slot, None)

    def _finish(self, slot: _Slot, error: Optional[BaseException]) -> None:
        self.running.remove(slot)
        try:
            self.lib.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
            self.lib.llama_sampler_free(slot.sampler)
        finally:
            self.free_ids.append(slot.seq_id)
            slot.job.on_done(error)

    def _sampler(self) -> Any:
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        s = self.sampling
        if s.temperature <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:  # (llama.cpp's order: the filters, then the temperature, then the draw)
            if s.top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(s.top_k))
            if s.top_p < 1.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(s.top_p, 1))
            if s.min_p > 0.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(s.min_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(s.temperature))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(self.seed))
        return chain


def serve_in_thread(scheduler: BatchScheduler) -> threading.Thread:
    """Start :meth:`BatchScheduler.serve` in a daemon thread."""
    thread = threading.Thread(target=scheduler.serve, name="llama-cpp-batch", daemon=True)
    thread.start()
    return thread
