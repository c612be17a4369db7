"""The model runner: executes exactly one :class:`~.plan.StepPlan` on the model and reports a
:class:`~.plan.StepOutput`. It knows no request's history beyond what a row carries (its tokens,
its sampler) and never reads or writes the KV manager: the plan brings the block tables and the
copies to make (:class:`~.plan.KVStep`).

A step: the planned chunk of a long prompt, the prompts prefilled as one batch (in
right-padded pieces; rows no longer wanted leave between pieces), the embedding inputs, then
the decode rows: one token each, or their drafts verified (:mod:`.drafting.verify`), or, when
the plan is pipelined, the tokens computed ahead last step taken and the next step queued
ahead (:class:`DecodeAhead`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import mlx.core as mx

from ..models import backends
from ..models.head import split_head
from ..models.lora.layers import rows_using
from . import compiled_step
from .compiled_step import CompiledDecode
from .decode_ahead import DecodeAhead
from .drafting.verify import verify_drafts
from .embed.forward import embed_step
from .kv.groups import LayerGroups
from .kv.paged_cache import PagedBatch
from .kv.states import RecurrentStates
from .kv.storage import PagedKVStorage
from .kv.support import layer_windows
from .plan import KVStep, StepOutput, StepPlan
from .prompt_logprobs import score_piece
from .request import Request
from .sampled import SampledRow
from .sampling import sample_requests

logger = logging.getLogger(__name__)

Wanted = Callable[[Request], bool]
"""Whether a request is still wanted (not cancelled, abandoned or past its deadline): asked
between prefill pieces."""


class ModelRunner:
    """Runs one engine's steps on its model over its KV arrays.

    Args:
        model: the mlx-lm model (its attention routed through the cache).
        storage: the KV blocks' arrays.
        windows: each layer's attention window (None: all tokens).
        groups: the layers sharing a block table (None: one group, a storage slot per layer).
        pad_id: the token padding positions carry.
        wanted: whether a request is still wanted, asked between prefill pieces.
        metrics: records embedding steps.
        decode_ahead: compute the next decode step ahead where the plan allows (``async_scheduling``).
        states: a hybrid model's recurrent layers' states (:mod:`.kv.states`), None for others.
    """

    def __init__(self, model: Any, storage: PagedKVStorage, pad_id: int, windows: Optional[list[Optional[int]]] = None,
                 groups: Optional[LayerGroups] = None, wanted: Wanted = lambda r: not r.finished, metrics: Any = None,
                 decode_ahead: bool = True, prefill_chunk_size: int = 512, states: Optional[RecurrentStates] = None) -> None:
        self.model, self.storage, self.pad_id, self.wanted, self.metrics = model, storage, pad_id, wanted, metrics
        self.states = states
        self.windows = windows or layer_windows(model) or [None] * len(model.layers)
        self.groups = groups
        self.num_groups = groups.count if groups is not None else 1
        self.prefill_chunk_size = prefill_chunk_size
        self.gathered = not backends.routes_attention(model)  # it attends itself over gathered K/V
        self.split = split_head(model)  # None: logits come from the whole model
        # Whether the last pass of several positions a row computed its rows' real positions
        # only (every layer one decoder-layer op): a verify step then costs by its drafts' total.
        self.ragged = False
        self.ahead = DecodeAhead(self) if decode_ahead else None
        self.kv = KVStep()  # the step's (see run())
        self._compiled: Optional[CompiledDecode] = None  # made at the first decode step where it applies
        self.compiled_off: Optional[str] = None  # why decode steps run uncompiled (None: not known yet, or compiled)

    def run(self, plan: StepPlan) -> StepOutput:
        """Execute ``plan``: its chunk, its prefill batch, its embeddings, then its decode rows."""
        out = StepOutput()
        self.kv = plan.kv
        self.storage.reserve(plan.kv.blocks, plan.kv.blocks_ahead)
        if plan.kv.saves:  # before anything is written: a block saved may be reused this step
            out.saved = self.storage.saved_blocks(plan.kv.saves)
        if plan.kv.loads:
            self.storage.load_blocks(plan.kv.loads)
        self.storage.copy_blocks(plan.kv.copies)
        for owner, name in plan.kv.state_loads.items():  # new rows starting after a cached prefix: its kept state
            self.states.load(plan.kv.state_slots[owner], name)  # type: ignore[union-attr]
        out.physical_blocks = self.storage.physical_blocks
        if plan.chunk is not None and self.wanted(plan.chunk[0]):
            self._chunk(*plan.chunk, out)
        prefill = [r for r in plan.prefill if self.wanted(r)]
        if prefill:
            self._prefill(prefill, out)
        if plan.embed:
            out.embedded, failed = embed_step(self.model, plan.embed, self.pad_id, self.metrics)  # a failure fails only its calls
            out.failed.extend((request, exc, "while embedding its inputs") for request, exc in failed)
        if self.ahead is not None and not plan.pipelined:
            self.ahead.drop()  # (what was computed ahead, its keys put back)
        rows = [r for r in plan.decode if self.wanted(r)]
        if rows:
            self._decode(plan, rows, out)
        return out

    def _chunk(self, request: Request, n: int, out: StepOutput) -> None:
        logits = self.chunk(request, n, out.prompt_logprobs)
        if logits is None:
            out.chunked = (request, n)
        else:
            out.prefilled.append(request)
            out.sampled.append((request, sample_requests(logits, [request])))

    def _prefill(self, requests: list[Request], out: StepOutput) -> None:
        # Recurrent layers that cannot keep a padded row's state at its own length take a row a pass.
        for batch in [requests] if self.states is None or self.states.padded else [[r] for r in requests]:
            ran = self.prefill(batch, max(1, self.prefill_chunk_size // len(batch)), out.prompt_logprobs)
            if ran is not None:
                rows, logits = ran
                out.prefilled.extend(rows)
                out.sampled.extend(zip(rows, _lists(sample_requests(logits, rows))))

    def _decode(self, plan: StepPlan, rows: list[Request], out: StepOutput) -> None:
        """One decode step of ``rows``: computed ahead, verifying drafts, or plain."""
        tic = time.perf_counter()
        got = self.ahead.step(rows, plan.ahead) if self.ahead is not None and plan.pipelined else None
        if got is not None:
            rows, sampled = got
            out.ahead = self.ahead.computing
        elif plan.verify is not None:
            sampled, out.drafts = verify_drafts(self, rows, plan.verify)
        else:
            sampled = _lists(sample_requests(self.decode(rows), rows))
        out.decode_seconds = time.perf_counter() - tic
        out.decoded = rows
        out.ragged = self.ragged
        out.sampled.extend(zip(rows, sampled))

    def forward(self, rows: list[Request], pieces: list[list[int]], starts: list[int], tokens: Optional[mx.array] = None,
                hidden: bool = False) -> mx.array:
        """``pieces[b]`` (tokens from position ``starts[b]`` on) of each row through the
        model, over the rows' blocks (``tokens``: the pieces as an array, ``(B, width)``, given
        instead); the logits, ``(B, width, vocab)`` (``hidden``: the final hidden states
        instead, where :attr:`split`). Narrow passes (decode, verify steps, short prefill
        pieces) attend through the block tables (see :class:`.PagedBatch`); a decode pass
        whose rows use no LoRA adapter runs compiled where it can (:mod:`.compiled_step`)."""
        width = max(len(p) for p in pieces)
        tables: list[Any] = [[self.kv.tables[id(r)][g] for r in rows] for g in range(self.num_groups)]
        if width == 1 and not hidden and not any(r.adapter for r in rows):
            compiled = self._compiled_decode()
            if compiled is not None:
                out = compiled(tokens if tokens is not None else mx.array(pieces), starts, tables[0])
                if out is not None:
                    return out
                self.compiled_off = compiled.off
        batch = PagedBatch(self.storage, tables[0] if self.groups is None else tables, starts, [len(p) for p in pieces], width,
                           self.windows, self.gathered, self.groups)
        if tokens is None:
            tokens = mx.array([p + [self.pad_id] * (width - len(p)) for p in pieces])
        caches = attention = batch.layers()
        if self.states is not None:
            state = self.states.open([self.kv.state_slots[id(r)] for r in rows], starts, [len(p) for p in pieces], width)
            caches = state.interleave(attention)
        with rows_using([r.adapter.slot if r.adapter else 0 for r in rows], [r.adapter.scale if r.adapter else 0.0 for r in rows]):
            out = self.model(tokens, cache=caches) if not hidden else self.split.body(tokens, caches)
        if self.states is not None:
            state.commit()
        if width > 1:
            self.ragged = all(c.ragged for c in attention)
        return out

    def decode_path(self) -> Optional[str]:
        """How decode steps' forward runs: ``"compiled"``, ``"uncompiled (why)"``, or None before the first."""
        if self._compiled is not None and self._compiled.off is None:
            return "compiled"
        return f"uncompiled ({self.compiled_off})" if self.compiled_off is not None else None

    def _compiled_decode(self) -> Optional[CompiledDecode]:
        """The compiled decode forward, made where it applies (:mod:`.compiled_step`); None elsewhere."""
        if self._compiled is None and self.compiled_off is None:
            if self.states is not None:
                why: Optional[str] = "recurrent layers (their state is written outside the pass's arrays)"
            else:
                why = compiled_step.applies(self.model, self.storage, self.windows, self.groups is not None, self.gathered)
            if why is None:
                self._compiled = CompiledDecode(self.model, self.storage, self.pad_id)
            self.compiled_off = why
        return self._compiled if self._compiled is not None and self._compiled.off is None else None

    def logits_where_asked(self, rows: list[Request], pieces: list[list[int]], starts: list[int]) -> "SpotLogits":
        """:meth:`forward`'s pass, evaluated (the KV written), its logits computed only at the
        positions later asked for (:meth:`SpotLogits.at`) where the model splits at its head
        (:func:`~...models.head.split_head`; else all of them now, as :meth:`forward`)."""
        if self.split is None:
            logits = self.forward(rows, pieces, starts)
            mx.eval(logits)
            return SpotLogits(logits, None, logits.shape[-1])
        hidden = self.forward(rows, pieces, starts, hidden=True)
        mx.eval(hidden)
        return SpotLogits(hidden, self.split.head, self.split.vocab)

    def decode(self, rows: list[Request]) -> mx.array:
        """One decode step: each row's last sampled token; logits ``(B, vocab)``."""
        return self.forward(rows, [[r.output_ids[-1]] for r in rows], [r.num_tokens - 1 for r in rows])[:, -1, :]

    def decode_ahead(self, rows: list[Request], tokens: mx.array) -> mx.array:
        """The decode step after the one that samples ``tokens`` (``(B,)``, not yet on the
        host: each row's next token, at position ``num_tokens``); logits ``(B, vocab)``."""
        return self.forward(rows, [[0]] * len(rows), [r.num_tokens for r in rows], tokens[:, None])[:, -1, :]

    def prefill(self, requests: list[Request], piece: int, scores: Optional[list[Any]] = None) -> Optional[tuple[list[Request], mx.array]]:
        """Prefill the requests' uncached tokens in right-padded pieces of ``piece``
        columns; the logits of each row's last token give its first sampled token. Where the
        model splits at its head (:attr:`split`), a row's last token goes in its last piece
        and only its hidden state goes through the head; else all but the last tokens go in
        pieces (a piece's logits are never computed), then the last tokens together in one
        column. Rows no longer wanted leave between pieces. Returns the rows kept and
        their logits, or None; the prompt logprobs of rows asking for them go to ``scores``
        (see :attr:`.StepOutput.prompt_logprobs`). (The requests' progress is the
        scheduler's to record.)"""
        seqs = {id(r): r.computed_ids for r in requests}
        done = {id(r): r.num_prefilled for r in requests}
        kept = {id(r): self._checkpoints(r) for r in requests}  # where a row's passes end to keep its state
        merged = self.split is not None
        last: dict[int, mx.array] = {}  # (merged) a row's last token's hidden state, once its last piece ran
        held = 0 if merged else 1  # the tokens a row keeps for the last column
        while True:
            active = [r for r in requests if done[id(r)] < len(seqs[id(r)]) - held]
            if not active:
                break
            pieces = [seqs[id(r)][done[id(r)] : min(done[id(r)] + piece, len(seqs[id(r)]) - held,
                                                    next((c for c in kept[id(r)] if c > done[id(r)]), len(seqs[id(r)])))]
                      for r in active]
            out = self.forward(active, pieces, [done[id(r)] for r in active], hidden=merged)
            self._score(active, pieces, [done[id(r)] for r in active], out, merged, scores)
            ending = [b for b, (r, p) in enumerate(zip(active, pieces)) if merged and done[id(r)] + len(p) == len(seqs[id(r)])]
            if ending:
                states = out[mx.array(ending), mx.array([len(pieces[b]) - 1 for b in ending])]
                last.update((id(active[b]), states[n]) for n, b in enumerate(ending))
            self._eval(*(last[id(active[b])] for b in ending))
            for r, p in zip(active, pieces):
                done[id(r)] += len(p)
                if done[id(r)] in kept[id(r)]:
                    self._keep_state(r, done[id(r)])
            requests = [r for r in requests if self.wanted(r)]
            if not requests:
                return None
        if merged and all(id(r) in last for r in requests):
            return requests, self.split.head(mx.stack([last[id(r)] for r in requests])[None])[0]
        logits = self.forward(requests, [seqs[id(r)][-1:] for r in requests], [len(seqs[id(r)]) - 1 for r in requests])[:, -1, :]
        return requests, logits

    def chunk(self, request: Request, n: int, scores: Optional[list[Any]] = None) -> Optional[mx.array]:
        """Prefill the next ``n`` tokens of a long prompt into its blocks; the logits of
        its last token once the whole prompt is in (else None). Where the model splits at
        its head (:attr:`split`), only the last token's hidden state goes through it; else
        the last chunk runs its last token alone, as :meth:`prefill` does: the model
        computes logits at every position it is given, and a chunk's are n x vocabulary
        floats (400 MB for 2,048 tokens of a 49k vocabulary). (The scheduler records the
        progress.) Its prompt logprobs, if asked for, go to ``scores``."""
        seq, start = request.computed_ids, request.num_prefilled
        end = start + n
        kept = self._checkpoints(request)
        for stop in kept:  # passes end where the state is kept
            if start < stop < end:
                every = self.forward([request], [seq[start:stop]], [start])
                self._score([request], [seq[start:stop]], [start], every, False, scores)
                self._eval()
                self._keep_state(request, stop)
                start = stop
        n = end - start
        if end == len(seq) and n > 1 and self.split is not None:
            hidden = self.forward([request], [seq[start:end]], [start], hidden=True)
            self._score([request], [seq[start:end]], [start], hidden, True, scores)
            return self.split.head(hidden[:, -1:, :])[:, -1, :]
        if end < len(seq) or n == 1:
            every = self.forward([request], [seq[start:end]], [start])
            self._score([request], [seq[start:end]], [start], every, False, scores)
            logits = every[:, -1, :]
        else:
            every = self.forward([request], [seq[start : end - 1]], [start])  # its logits are evaluated only to score them
            self._score([request], [seq[start : end - 1]], [start], every, False, scores)
            self._eval()
            logits = self.forward([request], [seq[end - 1 : end]], [end - 1])[:, -1, :]
        if end < len(seq):
            self._eval()
            if end in kept:
                self._keep_state(request, end)
            return None
        return logits

    def _checkpoints(self, request: Request) -> list[int]:
        """Where passes prefilling ``request`` end to keep its state (a hybrid model with
        prefix caching, :mod:`.kv.states`); none elsewhere."""
        return self.states.checkpoint_ends(len(request.computed_ids)) if self.states is not None else []

    def _keep_state(self, request: Request, position: int) -> None:
        """Keep ``request``'s state, just computed through ``position``, as a checkpoint."""
        self.states.save(self.kv.state_slots[id(request)], request.computed_ids, position, request.cache_namespace)  # type: ignore[union-attr]

    def _score(self, rows: list[Request], pieces: list[list[int]], starts: list[int], out: mx.array, hidden: bool,
               scores: Optional[list[Any]]) -> None:
        """Prompt logprobs of the rows asking for them, from a pass's ``out`` (its logits, or
        its final states where ``hidden``), into ``scores``."""
        if scores is None:
            return
        for b, (r, piece, start) in enumerate(zip(rows, pieces, starts)):
            if r.params.prompt_logprobs is not None:
                got = score_piece(out[b, : len(piece)], self.split.head if hidden else None, r.computed_ids, start, r.prompt_len,
                                  r.params.prompt_logprobs, backends.of(self.model))
                if got is not None:
                    scores.append((r, *got))

    def _eval(self, *more: mx.array) -> None:
        mx.eval(self.storage.arrays(), self.states.arrays() if self.states is not None else [], *more)



class SpotLogits:
    """A pass's logits at the positions asked for: indexed from the whole pass's logits, or
    computed by the model's head from its hidden states (``head`` given), only there."""

    def __init__(self, out: mx.array, head: Optional[Callable[[mx.array], mx.array]], vocab: int) -> None:
        self.out, self.head, self.vocab = out, head, vocab

    def at(self, spots: list[tuple[int, int]]) -> mx.array:
        """The logits ``(len(spots), vocab)`` of the positions ``(row, position)``, in order."""
        rows, positions = mx.array([b for b, _ in spots]), mx.array([j for _, j in spots])
        picked = self.out[rows, positions]
        return picked if self.head is None else self.head(picked[None])[0]


def _lists(rows: list[SampledRow]) -> list[list[SampledRow]]:
    """One sampled token a row, as the lists :attr:`.StepOutput.sampled` holds."""
    return [[row] for row in rows]
