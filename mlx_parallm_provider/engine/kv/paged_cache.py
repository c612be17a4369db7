"""What a model sees of the paged KV for one forward pass.

:class:`PagedBatch` describes the pass once (each row's block table, how many tokens it
already holds, how many it brings); :meth:`PagedBatch.layers` gives one
:class:`PagedLayerCache` per layer, the object mlx-lm's attention calls as its ``cache``:
``offset`` (each row's position, for RoPE), ``update_and_fetch`` (writes the new K/V into
the row's blocks) and ``attend`` (attention through the block tables; the model's backend
routes its attention there, passing itself: :meth:`~mlx_parallm_provider.models.backends.MLXOps.attend`).

Attention reads each row's blocks. On the CPU and GPU kernels backends, kernels read them
through the block tables (the backend's ``paged_decode_attention``) for every pass: a decode
step, a step verifying drafts or forced tokens, a prefill piece of any width (each position
sees the tokens before it and computes what a decode step there would). Elsewhere (MLX's
ops, layouts or pools the kernels do not take, attention sinks or a softcap on the CPU) rows are gathered, per length bucket,
into a transient rectangle (so a long row never makes short rows attend over its length),
then attended by the backend's ``dense_attention``.
Decoding rows whose tables start with the same cached
blocks (an agent's system prompt mapped into every table) gather those blocks once: the
shared prefix is attended as one matmul for all their queries and merged with each row's own
tokens by log-sum-exp (cascade attention, :func:`..cascade.cascade_attention`). A layer
with a sliding window (gemma3's local layers) attends only to the tokens its queries can
see: the last ``window`` before each query, as mlx-lm's ``RotatingKVCache`` and its windowed
mask give them (the kernel skips the rest; gathering takes only those). A model that computes
attention itself (``gathered``: an architecture whose attention is not routed) gets every row's keys and values
from ``update_and_fetch``, gathered layer by layer into one transient rectangle, and their
mask from ``make_mask``, as mlx-lm's batch cache gives them. Nothing outlives the pass but
the blocks. With groups of layers (:mod:`.groups`: gemma3's local and global layers), each
group's rows and tables are a :class:`GroupPass`, and a layer writes and reads its group's
blocks in its storage slot.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from ...models.backends import MLXOps
from .block_pool import NULL_BLOCK
from .buckets import Bucket, length_buckets
from .cascade import SharedPrefix, cascade_attention
from .groups import LayerGroups
from .storage import PagedKVStorage

_MLX_OPS = MLXOps()
MIN_SHARED_BLOCKS = 4
"""Decoding rows that share at least this many leading blocks attend to them as one cascade."""

TILE_SCORES = 1 << 20
"""A gathered prefill (no paged kernel) attends in tiles of queries holding at most this
many scores (4 MB in float32).
The softmax's intermediates are each as large as the scores: untiled, a 512-token chunk
over a 2,000-token row held ~280 MB at once on the default model, three times that row's
whole KV; in tiles ~80 MB, and the chunk ran faster (12.1 vs 17.7 s for the 2,000 tokens
on a 2-core Zen 3)."""


class NotTraceable(RuntimeError):
    """A pass built from arrays was asked for what only its rows' lists give."""


class PagedBatch:
    """One forward pass over rows of the paged KV.

    Args:
        storage: the layers' K/V arrays.
        tables: each row's block table (enough blocks for ``starts[b] + lengths[b]`` tokens);
            with ``groups``, one such list per group of layers.
        starts: tokens each row already holds (its first new token's position).
        lengths: new tokens of each row in this pass (at most ``width``; the rest is padding).
        width: the tokens axis of the pass's input.
        windows: each layer's sliding window (None: all tokens); without it, each layer's
            group's window (all None without groups).
        gathered: the model attends itself over what ``update_and_fetch`` returns (its
            attention is not routed through :meth:`PagedLayerCache.attend`).
        groups: which group's tables and which storage slot each layer uses
            (:class:`.groups.LayerGroups`); None: one group, a slot per layer.

    Every pass (a decode step, a step verifying drafts, a prefill piece) attends through the
    block tables where the backend has a paged kernel, each position as a decode step at that
    position would; elsewhere it gathers.
    """

    def __init__(self, storage: PagedKVStorage, tables: Sequence[Any], starts: Sequence[int], lengths: Sequence[int], width: int,
                 windows: Optional[Sequence[Optional[int]]] = None, gathered: bool = False, groups: Optional[LayerGroups] = None) -> None:
        self.storage, self.width, self.gathered = storage, width, gathered
        self.groups = groups if groups is not None else LayerGroups.single(storage.num_layers)
        self.windows = list(windows) if windows is not None else [self.groups.windows[g] for g, _ in self.groups.places]
        self.totals = [s + n for s, n in zip(starts, lengths)]
        self.offset = mx.array(list(starts), dtype=mx.int32)
        self.lengths = mx.array(self.totals, dtype=mx.int32)
        self.passes = [GroupPass(self, t, starts, lengths) for t in ([tables] if groups is None else tables)]

    @classmethod
    def of_arrays(cls, storage: PagedKVStorage, offset: mx.array, lengths: mx.array, write_slots: mx.array,
                  table: mx.array) -> "PagedBatch":
        """A decode pass (one position a row, one group of layers, no sliding window) whose
        rows come as arrays, not lists: ``offset`` ``(B,)`` each row's position, ``lengths``
        ``(B,)`` its tokens after the step, ``write_slots`` ``(B,)`` where its new K/V go,
        ``table`` ``(B, M)`` its blocks (a compiled step's inputs, :mod:`...compiled_step`).
        It attends through the block tables only: what would be built from the rows' lists
        (gathered buckets, shared prefixes) raises :class:`NotTraceable`."""
        batch = cls.__new__(cls)
        batch.storage, batch.width, batch.gathered = storage, 1, False
        batch.groups = LayerGroups.single(storage.num_layers)
        batch.windows = [None] * storage.num_layers
        batch.totals, batch.offset, batch.lengths = [], offset, lengths
        batch.passes = [GroupPass.of_arrays(batch, write_slots, table)]
        return batch

    def layers(self) -> list["PagedLayerCache"]:
        """One cache object per layer, for ``model(tokens, cache=...)``."""
        return [PagedLayerCache(self.passes[g], slot, self.windows[layer]) for layer, (g, slot) in enumerate(self.groups.places)]


class GroupPass:
    """A pass's rows in one group of layers: their tables, where the new tokens are written,
    and (built on first use) how attention reads them."""

    def __init__(self, batch: PagedBatch, tables: Sequence[Sequence[int]], starts: Sequence[int], lengths: Sequence[int]) -> None:
        storage, width = batch.storage, batch.width
        bs = storage.block_size
        self.batch, self.storage, self.width, self.totals = batch, storage, width, batch.totals
        writes = []
        for table, start, n in zip(tables, starts, lengths):
            row = [table[(start + i) // bs] * bs + (start + i) % bs for i in range(n)]
            writes.extend(row + [NULL_BLOCK * bs] * (width - n))
        storage.check(max(writes, default=0))
        self.write_slots = mx.array(writes, dtype=mx.int32)
        self._rows = (tables, starts, lengths)
        self._buckets: dict[Any, list[Bucket]] = {}
        self._shared: Optional[list[tuple[list[int], list[int]]]] = None
        longest = max((len(t) for t in tables), default=0)
        # For the paged decode kernel: block tables padded with the null block.
        self.table = mx.array([list(t) + [NULL_BLOCK] * (longest - len(t)) for t in tables], dtype=mx.int32)
        self.lengths = batch.lengths
        self._limits: Optional[mx.array] = batch.lengths if width == 1 else None

    @classmethod
    def of_arrays(cls, batch: PagedBatch, write_slots: mx.array, table: mx.array) -> "GroupPass":
        """(:meth:`PagedBatch.of_arrays`) the pass's one group, its rows as arrays only."""
        group = cls.__new__(cls)
        group.batch, group.storage, group.width, group.totals = batch, batch.storage, 1, batch.totals
        group.write_slots, group.table, group.lengths, group._limits = write_slots, table, batch.lengths, batch.lengths
        group._rows, group._buckets, group._shared = None, {}, None
        return group

    def _lists(self) -> tuple[Sequence[Sequence[int]], Sequence[int], Sequence[int]]:
        """The rows' tables, starts and lengths as lists."""
        if self._rows is None:
            raise NotTraceable("a pass built from arrays (a compiled step) attends through the block tables only")
        return self._rows

    @property
    def limits(self) -> mx.array:
        """The tokens each query position sees, ``(B,)`` for one position a row, else ``(B,
        width)`` (padding positions: their row's last real one's); built on first use (a
        gathered pass never asks)."""
        if self._limits is None:
            _, starts, lengths = self._lists()
            self._limits = mx.array([[s + min(j, max(n, 1) - 1) + 1 for j in range(self.width)] for s, n in zip(starts, lengths)],
                                    dtype=mx.int32)
        return self._limits

    def buckets(self, window: Optional[int] = None) -> list["Bucket"]:
        """Rows grouped by the length they attend over, each with its slots and mask, for
        layers of ``window`` (built on first use: the paged decode kernel reads block tables
        and needs none)."""
        if window not in self._buckets:
            tables, starts, lengths = self._lists()
            firsts = [0 if window is None else max(0, s - window + 1) for s in starts]
            spans = [t - f for t, f in zip(self.totals, firsts)]
            self._buckets[window] = [Bucket(idx, tables, starts, firsts, self.totals, self.width, self.storage.block_size, window)
                                     for idx in length_buckets(spans)]
        return self._buckets[window]

    def shared(self) -> list[tuple[list[int], list[int]]]:
        """For a decode pass: ``(blocks, rows)`` of each set of two rows or more whose
        tables start with the same :data:`MIN_SHARED_BLOCKS` blocks or more (whole blocks
        before every such row's query)."""
        if self._shared is None:
            tables, starts, _ = self._lists()
            by_first: dict[int, list[int]] = {}
            for b, table in enumerate(tables):
                if table and table[0] != NULL_BLOCK:
                    by_first.setdefault(table[0], []).append(b)
            groups = []
            for rows in by_first.values():
                if len(rows) < 2:
                    continue
                n = min(min(len(tables[b]) for b in rows), min(starts[b] for b in rows) // self.storage.block_size)
                common = 0
                while common < n and all(tables[b][common] == tables[rows[0]][common] for b in rows):
                    common += 1
                if common >= MIN_SHARED_BLOCKS:
                    groups.append((list(tables[rows[0]][:common]), rows))
            self._shared = groups
        return self._shared

    def own_buckets(self) -> list["Bucket"]:
        """Decode rows by length bucket over their own tokens: those after the shared
        prefix of their :meth:`shared` group, every token for the others."""
        if "own" not in self._buckets:
            tables, starts, _ = self._lists()
            firsts = [0] * len(tables)
            for blocks, rows in self.shared():
                for b in rows:
                    firsts[b] = len(blocks) * self.storage.block_size
            spans = [t - f for t, f in zip(self.totals, firsts)]
            self._buckets["own"] = [Bucket(idx, tables, starts, firsts, self.totals, self.width, self.storage.block_size)
                                    for idx in length_buckets(spans)]
        return self._buckets["own"]

    def whole(self, window: Optional[int] = None) -> "Bucket":
        """Every row in one bucket, in order (what a model attending itself is given)."""
        key = ("whole", window)
        if key not in self._buckets:
            tables, starts, _ = self._lists()
            firsts = [0 if window is None else max(0, s - window + 1) for s in starts]
            self._buckets[key] = [Bucket(list(range(len(tables))), tables, starts, firsts, self.totals, self.width, self.storage.block_size, window)]
        return self._buckets[key][0]


def _attend_tiled(backend: MLXOps, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array,
                  sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
    """``backend.dense_attention`` over tiles of the query positions, each within
    :data:`TILE_SCORES`. Each tile's queries depend on the previous tile's output
    (``mx.depends``), so MLX computes the tiles one after another, freeing each one's
    intermediates before the next (it would otherwise run them side by side, all their
    intermediates alive). Not ``mx.eval`` per tile: the worker must not re-enter Python in
    the middle of a step (at interpreter exit that aborts the process)."""
    B, heads, L, _ = queries.shape
    tile = max(1, TILE_SCORES // max(1, B * heads * keys.shape[2]))
    extra = {k: v for k, v in (("sinks", sinks), ("softcap", softcap)) if v is not None}
    if L <= tile:
        return backend.dense_attention(queries, keys, values, scale=scale, mask=mask, **extra)
    outs: list[mx.array] = []
    for i in range(0, L, tile):
        q = queries[:, :, i : i + tile]
        if outs:
            q = mx.depends(q, outs[-1])
        outs.append(backend.dense_attention(q, keys, values, scale=scale, mask=mask[:, :, i : i + tile], **extra))
    return mx.concatenate(outs, axis=2)


class PagedLayerCache:
    """One layer's view of a :class:`PagedBatch` (mlx-lm's cache interface): its group's
    rows and tables, its storage slot."""

    attends_sinks = True  # gpt-oss's attention sinks reach attend() (the GPU kernels, else the gathered path)
    attends_softcap = True  # so does gemma2's softcap (its routed attention: models.backends.softcapped)

    def __init__(self, batch: GroupPass, layer: int, window: Optional[int] = None) -> None:
        self.batch, self.layer, self.window = batch, layer, window  # layer: the storage slot
        self.written = False
        self.ragged = False  # the layer's op computed the pass's real positions only (see wrote())

    @property
    def offset(self) -> mx.array:
        """Each row's tokens held: before :meth:`update_and_fetch` its first new token's
        position (what RoPE reads), after it the row's end, as mlx-lm's caches count."""
        return self.batch.lengths if self.written else self.batch.batch.offset

    @property
    def state(self) -> tuple[Any, ...]:
        s = self.batch.storage
        return (s.keys[self.layer], s.values[self.layer])

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Optional[mx.array]:
        """None: attend() builds each bucket's mask from the block tables; for a model that
        attends itself, the mask of every row's gathered tokens, ``(B, 1, N, S)``."""
        return self.batch.whole(self.window).mask if self.batch.batch.gathered else None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the pass's new K/V (``(B, kv_heads, L, D)``) into the rows' blocks; return
        them (attend() reads the blocks), or, for a model that attends itself, every row's
        keys and values gathered from its blocks, ``(B, kv_heads, S, D)`` (:meth:`make_mask`'s S)."""
        B, H, L, D = keys.shape
        self.written = True
        flat_k = keys.swapaxes(1, 2).reshape(B * L, H, D)
        flat_v = values.swapaxes(1, 2).reshape(B * L, H, values.shape[-1])
        self.batch.storage.write(self.layer, self.batch.write_slots, flat_k, flat_v)
        if not self.batch.batch.gathered:
            return keys, values
        return self.batch.storage.read_heads(self.layer, self.batch.whole(self.window).slots)

    def can_attend_step(self, heads: int, width: int, backend: MLXOps) -> bool:
        """Whether :meth:`attend_step` takes this layer's step of ``heads`` query heads and
        ``width`` positions a row by ``backend``: rows attended through the block tables (no
        sliding window), pools its step takes (:meth:`.MLXOps.fits_attention_step`)."""
        batch, storage = self.batch, self.batch.storage
        pool = storage.keys[self.layer]
        return (self.window is None and width == batch.width and pool is not None and not batch.batch.gathered
                and backend.fits_attention_step(heads, pool, storage.scales[self.layer], storage.bits or 0))

    def step_inputs(self) -> tuple[Any, ...]:
        """What a fused step reads and writes (where :meth:`can_attend_step`): ``(k_pool,
        v_pool, write_slots, table, limits, offset, block_size, scales)`` (``scales``: a
        quantized layer's K scales and biases, V scales and biases; else None); the op that
        takes them writes the pools in place and is handed to :meth:`wrote`."""
        batch, storage = self.batch, self.batch.storage
        return (storage.keys[self.layer], storage.values[self.layer], batch.write_slots, batch.table, batch.limits,
                batch.batch.offset, storage.block_size, storage.scales[self.layer] if storage.bits else None)

    def wrote(self, out: mx.array, ragged: bool = False) -> None:
        """The op computing ``out`` wrote this layer's new K/V in place: later readers of the
        pools wait for it. ``ragged``: that op computed the real positions only (a padded
        pass's padding costs it nothing: the decoder-layer op)."""
        self.written, self.ragged = True, ragged
        self.batch.storage.written_in_place(self.layer, out)

    def attend_step(self, queries: mx.array, keys: mx.array, values: mx.array, heads: int, rope: Any, scale: float,
                    backend: MLXOps) -> mx.array:
        """The step's RoPE, K/V writes and attention by ``backend`` as one op (where
        :meth:`can_attend_step`): the projections ``(B, L, heads * D)`` / ``(B, L, kv_heads * D)``
        in, the attention ``(B, L, heads * D)`` out."""
        k_pool, v_pool, slots, table, limits, offset, block_size, scales = self.step_inputs()
        quantized = {"scales": scales} if scales else {}
        out = backend.paged_attention_step(queries, keys, values, k_pool, v_pool, slots, table, limits, offset, heads, rope,
                                           block_size, scale, **quantized)
        if backend.step_writes_in_place:
            self.wrote(out)
        else:  # (its scatters replaced the storage's arrays: their later readers see the writes)
            self.written = True
        return out

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any],
               backend: Optional[MLXOps] = None, sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
        """Attention of ``queries`` (B, heads, L, D) over each row's blocks by ``backend``
        (the model's; None: MLX's ops): one kernel call through the block tables where it
        has one (a sliding-window layer's too; with attention ``sinks`` or a ``softcap``, the
        GPU kernels' only), else per bucket over gathered blocks."""
        backend = backend or _MLX_OPS
        batch, storage = self.batch, self.batch.storage
        if backend.reads_pages:  # (asked only there: a wide pass's limits take a loop to build)
            extra = {"scales": storage.scales[self.layer], "bits": storage.bits} if storage.bits else {}
            if sinks is not None:
                extra["sinks"] = sinks
            if softcap is not None:
                extra["softcap"] = softcap
            out = backend.paged_decode_attention(queries, storage.keys[self.layer], storage.values[self.layer], batch.table,
                                                   batch.limits, storage.block_size, scale, window=self.window, **extra)
            if out is not None:
                return out
        cascade = batch.width == 1 and self.window is None and sinks is None and softcap is None and batch.shared()
        outs = []
        buckets = self.batch.own_buckets() if cascade else self.batch.buckets(self.window)
        prefixes = [(self._prefix(blocks), rows) for blocks, rows in batch.shared()] if cascade else []
        for bucket in buckets:
            k, v = self.batch.storage.read_heads(self.layer, bucket.slots)  # (b, kv_heads, S, D)
            q = queries if bucket.index is None else queries[bucket.index]
            if cascade:
                where = {b: i for i, b in enumerate(bucket.rows)}
                groups = [(p, mx.array([where[b] for b in rows if b in where])) for p, rows in prefixes if any(b in where for b in rows)]
                if groups:
                    outs.append(cascade_attention(q, k, v, scale, bucket.mask, groups, exp=backend.exp))
                    continue
            outs.append(_attend_tiled(backend, q, k, v, scale, bucket.mask, sinks, softcap))
        if len(outs) == 1:
            return outs[0]
        order = [b for bucket in buckets for b in bucket.rows]
        inverse = mx.array(sorted(range(len(order)), key=lambda i: order[i]), dtype=mx.int32)
        return mx.concatenate(outs, axis=0)[inverse]

    def _prefix(self, blocks: list[int]) -> SharedPrefix:
        """This layer's K and V of ``blocks`` (a shared prefix), ``(1, kv_heads, tokens, D)``."""
        storage = self.batch.storage
        k, v = storage.read_heads(self.layer, storage.block_slots(blocks))
        return SharedPrefix(k[None], v[None], ())

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False
