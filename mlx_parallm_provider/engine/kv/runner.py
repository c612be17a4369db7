"""Forward passes over paged KV: prefill in right-padded pieces, chunks of a long prompt,
decode steps, and moving a row's KV between blocks and the prefix store.

:class:`PagedRunner` runs what the worker asks on the rows' blocks and returns logits; it
never decides who runs (the scheduler does) and never touches a request's results (the
worker does). The blocks each row uses are the :class:`~.manager.KVCacheManager`'s.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import mlx.core as mx

from ...config import EngineConfig
from ..prefix_cache import PrefixCache, kv_range
from ..request import Request
from .budget import pool_blocks
from .manager import KVCacheManager
from .paged_cache import PagedBatch
from .storage import PagedKVStorage
from .support import read_row, unsupported_reason, write_prefix

logger = logging.getLogger(__name__)

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

    def __init__(self, model: Any, kv: KVCacheManager, storage: PagedKVStorage, pad_id: int) -> None:
        self.model, self.kv, self.storage, self.pad_id = model, kv, storage, pad_id

    @classmethod
    def for_model(cls, model: Any, config: EngineConfig, bytes_per_token: int, context_length: int, pad_id: int) -> Optional["PagedRunner"]:
        """The paged runner ``config`` asks for, or None where ``model`` keeps the rectangle
        layout (logged, with the reason)."""
        reason = unsupported_reason(model, config)
        if reason is not None:
            if config.kv_layout == "paged":
                logger.info("KV cache: the rectangle layout (%s)", reason)
            return None
        return cls.create(model, config.kv_cache_memory_bytes, bytes_per_token, config.kv_block_size,
                          config.max_num_seqs * max(context_length, 1), pad_id)

    @classmethod
    def create(cls, model: Any, budget_bytes: Optional[int], bytes_per_token: int, block_size: int, max_tokens: int, pad_id: int) -> "PagedRunner":
        """A runner with its own pool: ``budget_bytes`` of blocks (all allocated at once),
        or, without a budget, room for ``max_tokens`` within the free memory, grown on use."""
        blocks = pool_blocks(budget_bytes, bytes_per_token, block_size, max_tokens)
        kv = KVCacheManager(blocks, block_size)
        return cls(model, kv, PagedKVStorage(len(model.layers), blocks, block_size, preallocate=budget_bytes is not None), pad_id)

    def reserve(self) -> None:
        """Make the arrays hold every block the tables use (after the scheduler planned)."""
        self.storage.reserve(self.kv.pool.high_water())

    def stats(self) -> dict[str, Any]:
        return {"layout": "paged", **self.kv.stats(), "kv_cache_bytes": self.storage.nbytes}

    def forward(self, rows: list[Request], pieces: list[list[int]], starts: list[int]) -> mx.array:
        """``pieces[b]`` (tokens from position ``starts[b]`` on) of each row through the
        model, over the rows' blocks; the logits, ``(B, width, vocab)``."""
        width = max(len(p) for p in pieces)
        self.reserve()
        batch = PagedBatch(self.storage, [self.kv.table(id(r)) for r in rows], starts, [len(p) for p in pieces], width)
        tokens = mx.array([p + [self.pad_id] * (width - len(p)) for p in pieces])
        return self.model(tokens, cache=batch.layers())

    def decode(self, rows: list[Request]) -> mx.array:
        """One decode step: each row's last sampled token; logits ``(B, vocab)``."""
        return self.forward(rows, [[r.output_ids[-1]] for r in rows], [r.num_tokens - 1 for r in rows])[:, -1, :]

    def prefill(self, requests: list[Request], piece: int, wanted: Wanted) -> Optional[tuple[list[Request], mx.array]]:
        """Prefill the requests' uncached tokens in right-padded pieces of ``piece``
        columns, all but each row's last token, then the last tokens together in one
        column, whose logits give the first sampled tokens. Rows no longer ``wanted``
        leave between pieces. Returns the rows kept and their logits, or None."""
        for r in requests:
            self._fill_cached_prefix(r)
        seqs = {id(r): r.computed_ids for r in requests}
        while True:
            active = [r for r in requests if r.num_prefilled < len(seqs[id(r)]) - 1]
            if not active:
                break
            pieces = [seqs[id(r)][r.num_prefilled : min(r.num_prefilled + piece, len(seqs[id(r)]) - 1)] for r in active]
            self.forward(active, pieces, [r.num_prefilled for r in active])
            self._eval()
            for r, p in zip(active, pieces):
                r.num_prefilled += len(p)
            requests = [r for r, keep in zip(requests, wanted(requests)) if keep]
            if not requests:
                return None
        logits = self.forward(requests, [seqs[id(r)][-1:] for r in requests], [r.num_prefilled for r in requests])[:, -1, :]
        for r in requests:
            r.num_prefilled = len(seqs[id(r)])
        return requests, logits

    def chunk(self, request: Request, n: int) -> Optional[mx.array]:
        """Prefill the next ``n`` tokens of a long prompt into its blocks; the logits of
        its last token once the whole prompt is in (else None)."""
        if request.num_prefilled == request.num_cached:
            self._fill_cached_prefix(request)
        seq, start = request.computed_ids, request.num_prefilled
        logits = self.forward([request], [seq[start : start + n]], [start])[:, -1, :]
        request.num_prefilled += n
        if request.num_prefilled < len(seq):
            self._eval()
            return None
        return logits

    def store(self, store: Optional[PrefixCache], requests: list[Request], sequences: list[list[int]], held: list[int], bytes_per_token: int) -> None:
        """Put the first ``held[j]`` tokens of ``sequences[j]`` (row ``requests[j]``'s KV) into
        the prefix store; a failure is logged and costs nothing else."""
        if store is None:
            return
        try:
            for r, seq, n in zip(requests, sequences, held):
                def source(a: int, b: int, r: Request = r) -> list[Any]:
                    return read_row(self.storage, self.kv, id(r), a, b)
                store.insert(seq[:n], source, bytes_per_token)
        except Exception:
            logger.exception("could not store KV in the prefix cache")

    def _fill_cached_prefix(self, request: Request) -> None:
        """Copy the request's fetched prefix (``num_cached`` tokens) into its blocks."""
        state: Any = request.state
        prefix, state.prefix = state.prefix, None
        if prefix and request.num_cached:
            write_prefix(self.storage, self.kv, id(request), kv_range(prefix, 0, request.num_cached))

    def _eval(self) -> None:
        mx.eval([a for a in (*self.storage.keys, *self.storage.values) if a is not None])
