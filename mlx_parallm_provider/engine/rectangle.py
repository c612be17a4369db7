"""Prefill on the rectangle layout (``kv_layout="rectangle"``, rotating caches, models the
paged KV cannot serve): a batch of prompts into one left-padded mlx-lm batch cache, and
chunks of a long prompt into a cache of its own. The counterpart of
:class:`~.kv.runner.PagedRunner`; the worker joins the resulting cache to its decode batch."""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from .output import RowState
from .prefill import new_batch_cache, run_pieces, run_right_padded
from .prefix_kv import adopt_shared_prefixes, batch_cache_from_prefixes, store_rows
from .request import Request

WantedFor = Callable[[list[Request]], Callable[[], list[bool]]]
"""``wanted_for(requests)``: a callback saying, between pieces, which are still wanted."""


def prefill_batch(model: Any, requests: list[Request], piece: int, pad_id: int, share: bool, max_kv_size: Optional[int],
                  wanted_for: WantedFor) -> Optional[tuple[list[Request], mx.array, list[Any]]]:
    """Prefill whole prompts (or what follows their cached prefix) as one left-padded batch,
    in pieces of ``piece`` columns. Returns the rows kept, their last logits and the batch
    cache, or None when every row has gone."""
    layers = len(model.layers)
    if any(r.num_cached for r in requests):
        cache = batch_cache_from_prefixes(layers, requests, share, max_kv_size)
        rest = [r.prompt_ids[r.num_cached :] for r in requests]
        if len({len(x) for x in rest}) > 1:  # all but the last tokens, right-padded
            kept = run_right_padded(model, [x[:-1] for x in rest], cache, pad_id, piece, wanted_for(requests))
            if kept is None:
                return None
            requests, rest = [requests[i] for i in kept], [rest[i][-1:] for i in kept]
        tokens = mx.array(rest)
    else:
        longest = max(r.prompt_len for r in requests)
        padding = [longest - r.prompt_len for r in requests]
        tokens = mx.array([[pad_id] * p + r.prompt_ids for p, r in zip(padding, requests)])
        cache = new_batch_cache(layers, padding, max_kv_size, share)
    ran = run_pieces(model, tokens, cache, piece, True, wanted_for(requests))
    if ran is None:
        return None
    requests = [requests[i] for i in ran[0]]
    logits = model(ran[1], cache=cache)[:, -1, :]
    return requests, logits, cache


def prefill_chunk(model: Any, request: Request, n: int, share: bool, max_kv_size: Optional[int]) -> Optional[tuple[mx.array, list[Any]]]:
    """Prefill the next ``n`` prompt tokens of a long prompt into its own cache; its last
    logits and that cache once the whole prompt is in (else None)."""
    state: RowState = request.state  # type: ignore[assignment]
    if state.cache is None:
        layers = len(model.layers)
        state.cache = batch_cache_from_prefixes(layers, [request], share, max_kv_size) if request.num_cached else new_batch_cache(layers, [0], max_kv_size, share)
    start = request.num_prefilled  # (the scheduler advances it after the chunk)
    logits = model(mx.array([request.prompt_ids[start : start + n]]), cache=state.cache)[:, -1, :]
    if start + n < request.prompt_len:
        mx.eval([c.state for c in state.cache])
        return None
    cache, state.cache = state.cache, None
    return logits, cache


class RectangleBatch:
    """The rectangle layout's decode batch: one left-padded batch cache whose row ``i`` is
    :attr:`rows` ``[i]``. Joining extends it (padding every row to the longest) and leaving
    filters it, each copying the whole batch's KV. Which rows decode is the plan's; the
    order of their KV is this batch's."""

    def __init__(self) -> None:
        self.cache: Optional[list[Any]] = None
        self.rows: list[Request] = []

    def join(self, cache: list[Any], joining: list[Request], store: Any, bytes_per_token: int) -> None:
        """Append ``joining`` (prefilled into ``cache``) after the rows; their prompts go to the store."""
        store_rows(store, cache, [r.prompt_ids for r in joining], range(len(joining)), bytes_per_token)
        if self.cache is None:
            self.cache = cache
        else:
            adopt_shared_prefixes(self.cache, [r.prompt_ids for r in self.rows], cache)
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        self.rows.extend(joining)

    def decode(self, model: Any, rows: list[Request]) -> mx.array:
        """One decode step of the batch; the logits of ``rows`` (each one of the batch's,
        all of them: KeyError otherwise), in their order, ``(B, vocab)``."""
        if len(rows) != len(self.rows):
            raise ValueError(f"{len(rows)} rows asked to decode, the batch holds {len(self.rows)}")
        logits = model(mx.array([r.output_ids[-1] for r in self.rows])[:, None], cache=self.cache)[:, -1, :]
        position = {id(r): i for i, r in enumerate(self.rows)}
        order = [position[id(r)] for r in rows]
        return logits if order == list(range(len(order))) else logits[mx.array(order)]

    def store(self, store: Any, request: Request, bytes_per_token: int) -> None:
        """Put a finished row's prompt + answer into the store (for a next turn)."""
        row = next((i for i, r in enumerate(self.rows) if r is request), None)
        if row is not None:
            store_rows(store, self.cache, [request.prompt_ids + request.output_ids], [row], bytes_per_token)

    def evict_finished(self) -> None:
        """Drop the finished rows' KV (filtering every layer's cache when any has finished)."""
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = None
        else:
            for c in self.cache or []:
                c.filter(keep)
