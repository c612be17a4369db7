"""The K and V arrays behind a block pool: one pair per layer, slot-major. (With groups of
layers, :mod:`.groups`, one pair per storage slot: a block of a group holds that group's
layers, its ``s``-th layer in slot ``s``.)

Layer ``l``'s keys are ``keys[l]`` of shape ``(blocks * block_size, kv_heads, head_dim)``:
token ``t`` of a row whose block table is ``table`` lives at slot
``table[t // block_size] * block_size + t % block_size``. Writes are in-place scatters (MLX
donates the buffer), so a step's cost is its own tokens, never the batch's.

The arrays are created at the first write (shapes from the model's own K/V, dtype the
engine's ``kv_cache_dtype`` or else theirs; reads give the model's dtype back) and
hold as many blocks as :meth:`reserve` last asked for, up to the pool's size: with an
explicit budget that is the whole pool at once; otherwise they grow as the highest block in
use rises (the pool hands out cached blocks again before it grows them), so a small workload
holds little memory: by a quarter (:data:`GROWTH`), but not past what the requests holding
blocks can still use (``cap``: a long prompt's arrays stop near its prompt + ``max_tokens``),
and by a sixteenth at least (:data:`MIN_GROWTH`). Growing copies the arrays
(MLX cannot extend one in place) one layer at a time, so the copy's transient is one
layer's arrays, not the whole pool's.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

GROWTH = 4
"""The arrays grow by at least 1/GROWTH of their size: a larger step copies less often
(each growth copies every block held), a smaller one holds fewer blocks nobody uses yet."""

MIN_GROWTH = 16
"""Growth capped at the requests' need is still 1/MIN_GROWTH of the arrays at least: a
series of requests each a little past the last peak copies the arrays a bounded number of
times per doubling, not once per request."""


class PagedKVStorage:
    """Per-layer K/V pools for ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, preallocate: bool = False,
                 dtype: Optional[mx.Dtype] = None) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.dtype = dtype  # of the arrays; None: the model's K/V dtype
        self.compute_dtype: Optional[mx.Dtype] = None  # the model's K/V dtype, known at the first write
        self.keys: list[Optional[mx.array]] = [None] * num_layers
        self.values: list[Optional[mx.array]] = [None] * num_layers
        self._blocks = num_blocks if preallocate else 0  # blocks the arrays hold (or will, once created)

    @property
    def physical_blocks(self) -> int:
        """Blocks the arrays hold now (or will hold when created)."""
        return self._blocks

    @property
    def nbytes(self) -> int:
        """Bytes the K and V arrays hold."""
        return sum(a.nbytes for a in (*self.keys, *self.values) if a is not None)

    def reserve(self, blocks: int, cap: Optional[int] = None) -> None:
        """Make the arrays hold at least ``blocks`` blocks: by :data:`GROWTH` at least, but
        not past ``cap`` (the most the present requests can use) unless that is less than
        :data:`MIN_GROWTH`; never past the pool."""
        if blocks <= self._blocks:
            return
        ahead = max(self._blocks + self._blocks // GROWTH, 16)
        if cap is not None:
            ahead = min(ahead, max(cap, self._blocks + self._blocks // MIN_GROWTH, 16))
        target = min(self.num_blocks, max(blocks, ahead))
        extra = (target - self._blocks) * self.block_size
        for arrays in (self.keys, self.values):
            for layer, a in enumerate(arrays):
                if a is not None:
                    arrays[layer] = mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)])
                    mx.eval(arrays[layer])  # now, so one layer's old array at most is held beside its copy
        self._blocks = target

    def check(self, highest_slot: int) -> None:
        """Raise unless ``highest_slot`` lies in the arrays (MLX's scatters and gathers do
        not check their indices: one past the end would corrupt memory)."""
        if highest_slot >= self._blocks * self.block_size:
            raise IndexError(f"KV slot {highest_slot} is past the {self._blocks} blocks reserved")

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Put ``keys`` / ``values`` (``(n, kv_heads, head_dim)``) at ``slots`` (``(n,)``)."""
        if self.keys[layer] is None:
            size = self._blocks * self.block_size
            self.compute_dtype = keys.dtype
            self.keys[layer] = mx.zeros((size, *keys.shape[1:]), self.dtype or keys.dtype)
            self.values[layer] = mx.zeros((size, *values.shape[1:]), self.dtype or values.dtype)
        self.keys[layer][slots] = keys.astype(self.keys[layer].dtype)  # type: ignore[index]
        self.values[layer][slots] = values.astype(self.values[layer].dtype)  # type: ignore[index]

    def written_in_place(self, layer: int, by: mx.array) -> None:
        """``layer``'s arrays were written in place by the op computing ``by`` (the fused
        attention step): later readers of them wait for it."""
        self.keys[layer], self.values[layer] = mx.depends([self.keys[layer], self.values[layer]], [by])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``source -> destination`` in every layer (copy on write)."""
        if not pairs or self.keys[0] is None:
            return
        bs = self.block_size
        src = mx.array([s * bs + i for s, _ in pairs for i in range(bs)], dtype=mx.int32)
        dst = mx.array([d * bs + i for _, d in pairs for i in range(bs)], dtype=mx.int32)
        self.check(max(max(s, d) for s, d in pairs) * bs + bs - 1)
        for arrays in (self.keys, self.values):
            for layer, a in enumerate(arrays):
                if a is not None:
                    a[dst] = a[src]

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K and V at ``slots`` (any shape ``s``): arrays of shape ``(*s, kv_heads, head_dim)``,
        in the model's dtype."""
        k, v = self.keys[layer][slots], self.values[layer][slots]  # type: ignore[index]
        if self.compute_dtype is not None and k.dtype != self.compute_dtype:
            k, v = k.astype(self.compute_dtype), v.astype(self.compute_dtype)
        return k, v
