"""Forward passes over paged KV: prefill in right-padded pieces, chunks of a long prompt,
decode steps.

:class:`PagedRunner` runs what the worker asks on the rows' blocks and returns logits; it
only reads requests: it never decides who runs nor records how far a prompt is prefilled
(the scheduler does both) and never touches a request's results (the worker does). The
blocks each row uses are the :class:`~.manager.KVCacheManager`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from ...config import EngineConfig
from ...models import backends
from ...models.head import split_head
from ..request import Request
from .budget import pool_blocks
from .manager import KVCacheManager
from .groups import LayerGroups
from .paged_cache import PagedBatch
from .storage import PagedKVStorage
from .support import layer_windows, with_max_kv_size

Wanted = Callable[[list[Request]], list[bool]]
"""Called between prefill pieces: which of these requests are still wanted."""


class PagedRunner:
    """A model's forward passes over the paged KV of one engine.

    Args:
        model: the mlx-lm model (its attention routed through the cache).
        kv: the block tables (the scheduler's, shared).
        storage: the blocks' arrays.
        pad_id: the token padding positions carry.
    """

    def __init__(self, model: Any, kv: KVCacheManager, storage: PagedKVStorage, pad_id: int, caching: bool = True,
                 windows: Optional[list[Optional[int]]] = None, groups: Optional[LayerGroups] = None) -> None:
        self.model, self.kv, self.storage, self.pad_id, self.caching = model, kv, storage, pad_id, caching
        self.windows = windows or layer_windows(model) or [None] * len(model.layers)
        self.groups = groups  # None: one group, a storage slot per layer
        self.gathered = not backends.routes_attention(model)  # it attends itself over gathered K/V
        self.split = split_head(model)  # None: logits come from the whole model
        # Whether the last pass of several positions a row computed its rows' real positions
        # only (every layer one decoder-layer op): a verify step then costs by its drafts' total.
        self.ragged = False

    @classmethod
    def for_model(cls, model: Any, config: EngineConfig, bytes_per_token: int, context_length: int, pad_id: int) -> "PagedRunner":
        """The paged runner ``config`` asks for (``model`` passed :func:`.support.unsupported_reason`)."""
        runner = cls.create(model, config.kv_cache_memory_bytes, bytes_per_token, config.kv_block_size,
                            config.max_num_seqs * max(context_length, 1), pad_id,
                            max_cached_tokens=config.prefix_cache_memory_bytes // max(1, bytes_per_token), max_kv_size=config.max_kv_size,
                            kv_dtype=None if config.kv_cache_dtype == "auto" else getattr(mx, config.kv_cache_dtype))
        runner.caching = config.enable_prefix_caching
        return runner

    @classmethod
    def create(cls, model: Any, budget_bytes: Optional[int], bytes_per_token: int, block_size: int, max_tokens: int, pad_id: int,
               max_cached_tokens: Optional[int] = None, max_kv_size: Optional[int] = None,
               kv_dtype: Optional[mx.Dtype] = None) -> "PagedRunner":
        """A runner with its own pool: ``budget_bytes`` of blocks (all allocated at once),
        or, without a budget, room for ``max_tokens`` within the free memory, grown on use;
        at most ``max_cached_tokens`` of it named by the prefix cache. ``max_kv_size``: every
        layer attends to at most that many recent tokens, and older blocks are released.
        Layers of different windows (gemma3's local and global) get a group each
        (:mod:`.groups`): a local group's blocks past its window are released too.
        ``kv_dtype``: the blocks' dtype (None: the model's K/V dtype)."""
        layers = len(model.layers)
        windows = with_max_kv_size(layer_windows(model) or [None] * layers, max_kv_size)
        groups = LayerGroups.of(windows)
        # A block holds `groups.size` layers' K/V: a token costs that share of all layers' bytes in each group.
        blocks = pool_blocks(budget_bytes, bytes_per_token * groups.size // layers, block_size, max_tokens * groups.count)
        cached = None if max_cached_tokens is None else max(1, max_cached_tokens * groups.count // block_size)
        kv = KVCacheManager(blocks, block_size, cached, windows=groups.windows)
        storage = PagedKVStorage(groups.size, blocks, block_size, preallocate=budget_bytes is not None, dtype=kv_dtype)
        return cls(model, kv, storage, pad_id, windows=windows, groups=groups if groups.count > 1 else None)

    def prefix_options(self, config: EngineConfig) -> dict[str, Any]:
        """The scheduler's prefix-sharing arguments: prefixes are the pool's cached blocks."""
        return {"prefix_caching": config.enable_prefix_caching, "prefix_capacity_tokens": self.kv.capacity_tokens}

    def prefix_stats(self, bytes_per_token: int) -> Optional[dict[str, Any]]:
        """The prefix cache's counts: bytes, tokens, evictions, bound (None when off)."""
        if not self.caching:
            return None
        pool, bs = self.kv.pool, self.kv.block_size
        count = len(self.kv.windows)  # with groups, a block holds one group's layers: a token takes a block slot in each
        block_bytes = bs * bytes_per_token * self.storage.num_layers // len(self.model.layers)
        cached, bound = pool.num_cached * block_bytes, (pool.max_cached or pool.num_usable) * block_bytes
        return {"cached_bytes": cached, "cached_tokens_stored": pool.num_cached * bs // count, "evictions": pool.evictions,
                "evicted_tokens": pool.evictions * bs // count, "max_bytes": bound, "nbytes": cached, "cached_blocks": pool.num_cached}

    def reserve(self) -> None:
        """After the scheduler planned: make the arrays hold every block the tables use, and
        make the block copies it queued (cached prefixes' partly shared last blocks). The
        arrays grow ahead at most to what the requests holding blocks can still add."""
        high = self.kv.pool.high_water()
        self.storage.reserve(high, high + self.kv.blocks_to_come())
        self.kv.pool.physical = self.storage.physical_blocks
        self.storage.copy_blocks(self.kv.copied())

    def stats(self) -> dict[str, Any]:
        return {"layout": "paged", **self.kv.stats(), "kv_cache_bytes": self.storage.nbytes}

    def forward(self, rows: list[Request], pieces: list[list[int]], starts: list[int], tokens: Optional[mx.array] = None,
                hidden: bool = False) -> mx.array:
        """``pieces[b]`` (tokens from position ``starts[b]`` on) of each row through the
        model, over the rows' blocks (``tokens``: the pieces as an array, ``(B, width)``, given
        instead); the logits, ``(B, width, vocab)`` (``hidden``: the final hidden states
        instead, where :attr:`split`). Narrow passes (decode, verify steps, short prefill
        pieces) attend through the block tables (see :class:`.PagedBatch`)."""
        width = max(len(p) for p in pieces)
        self.reserve()
        tables: list[Any] = [[self.kv.table(id(r), g) for r in rows] for g in range(len(self.kv.windows))]
        batch = PagedBatch(self.storage, tables[0] if self.groups is None else tables, starts, [len(p) for p in pieces], width,
                           self.windows, self.gathered, self.groups)
        if tokens is None:
            tokens = mx.array([p + [self.pad_id] * (width - len(p)) for p in pieces])
        caches = batch.layers()
        out = self.model(tokens, cache=caches) if not hidden else self.split.body(tokens, caches)
        if width > 1:
            self.ragged = all(c.ragged for c in caches)
        return out

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

    def prefill(self, requests: list[Request], piece: int, wanted: Wanted) -> Optional[tuple[list[Request], mx.array]]:
        """Prefill the requests' uncached tokens in right-padded pieces of ``piece``
        columns; the logits of each row's last token give its first sampled token. Where the
        model splits at its head (:attr:`split`), a row's last token goes in its last piece
        and only its hidden state goes through the head; else all but the last tokens go in
        pieces (a piece's logits are never computed), then the last tokens together in one
        column. Rows no longer ``wanted`` leave between pieces. Returns the rows kept and
        their logits, or None. (The requests' progress is the scheduler's to record: see
        :meth:`.Scheduler.started`.)"""
        seqs = {id(r): r.computed_ids for r in requests}
        done = {id(r): r.num_prefilled for r in requests}
        merged = self.split is not None
        last: dict[int, mx.array] = {}  # (merged) a row's last token's hidden state, once its last piece ran
        held = 0 if merged else 1  # the tokens a row keeps for the last column
        while True:
            active = [r for r in requests if done[id(r)] < len(seqs[id(r)]) - held]
            if not active:
                break
            pieces = [seqs[id(r)][done[id(r)] : min(done[id(r)] + piece, len(seqs[id(r)]) - held)] for r in active]
            out = self.forward(active, pieces, [done[id(r)] for r in active], hidden=merged)
            ending = [b for b, (r, p) in enumerate(zip(active, pieces)) if merged and done[id(r)] + len(p) == len(seqs[id(r)])]
            if ending:
                states = out[mx.array(ending), mx.array([len(pieces[b]) - 1 for b in ending])]
                last.update((id(active[b]), states[n]) for n, b in enumerate(ending))
            self._eval(*(last[id(active[b])] for b in ending))
            for r, p in zip(active, pieces):
                done[id(r)] += len(p)
            requests = [r for r, keep in zip(requests, wanted(requests)) if keep]
            if not requests:
                return None
        if merged and all(id(r) in last for r in requests):
            return requests, self.split.head(mx.stack([last[id(r)] for r in requests])[None])[0]
        logits = self.forward(requests, [seqs[id(r)][-1:] for r in requests], [len(seqs[id(r)]) - 1 for r in requests])[:, -1, :]
        return requests, logits

    def chunk(self, request: Request, n: int) -> Optional[mx.array]:
        """Prefill the next ``n`` tokens of a long prompt into its blocks; the logits of
        its last token once the whole prompt is in (else None). Where the model splits at
        its head (:attr:`split`), only the last token's hidden state goes through it; else
        the last chunk runs its last token alone, as :meth:`prefill` does: the model
        computes logits at every position it is given, and a chunk's are n x vocabulary
        floats (400 MB for 2,048 tokens of a 49k vocabulary). (The scheduler records the
        progress: :meth:`.Scheduler.advanced`.)"""
        seq, start = request.computed_ids, request.num_prefilled
        end = start + n
        if end == len(seq) and n > 1 and self.split is not None:
            hidden = self.forward([request], [seq[start:end]], [start], hidden=True)
            return self.split.head(hidden[:, -1:, :])[:, -1, :]
        if end < len(seq) or n == 1:
            logits = self.forward([request], [seq[start:end]], [start])[:, -1, :]
        else:
            self.forward([request], [seq[start : end - 1]], [start])  # its logits are never evaluated
            self._eval()
            logits = self.forward([request], [seq[end - 1 : end]], [end - 1])[:, -1, :]
        if end < len(seq):
            self._eval()
            return None
        return logits

    def _eval(self, *more: mx.array) -> None:
        mx.eval([a for a in (*self.storage.keys, *self.storage.values) if a is not None], *more)


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
