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

Quantized blocks (``kv_cache_dtype`` ``"int8"`` / ``"int4"``): each token's K (and V) of a
head is quantized on write in groups of :data:`KV_QUANT_GROUP_SIZE` dimensions, affinely, as
``mx.quantize`` does (mlx-lm's ``QuantizedKVCache`` too): ``keys[l]`` / ``values[l]`` hold
the packed codes (uint32, ``(slots, kv_heads, D * bits / 32)``) and :attr:`PagedKVStorage.scales`
each layer's ``(key_scales, key_biases, value_scales, value_biases)``, float16 ``(slots,
kv_heads, D / group)``. A slot's codes and scales depend on that token alone, so a block
shared, copied, cut back (rejected drafts) or released is handled as any other; reads
dequantize what they gather (in the model's dtype), and the CPU kernel reads the codes
directly (:func:`mlx_parallm_provider.models.attention.paged_decode_attention`), dequantizing a tile at a time.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .disk_tier import BlockData

GROWTH = 4
"""The arrays grow by at least 1/GROWTH of their size: a larger step copies less often
(each growth copies every block held), a smaller one holds fewer blocks nobody uses yet."""

MIN_GROWTH = 16
"""Growth capped at the requests' need is still 1/MIN_GROWTH of the arrays at least: a
series of requests each a little past the last peak copies the arrays a bounded number of
times per doubling, not once per request."""


KV_QUANT_GROUP_SIZE = 32
"""Dimensions of a head's K or V that share one scale and bias in quantized blocks: 32 keeps
int4's error within what greedy decoding tolerates on small heads (64: half the scales'
bytes, twice the error), and divides every common head size (64, 96, 128, 256)."""

QUANTIZED_KV_BITS = {"int8": 8, "int4": 4}
"""``kv_cache_dtype`` values that quantize the blocks, and their bits."""

SCALES_DTYPE = mx.float16


def quantized_bytes_per_value(bits: int) -> float:
    """Bytes one K or V value takes in quantized blocks: its code plus its share of its
    group's float16 scale and bias."""
    return bits / 8 + 2 * SCALES_DTYPE.size / KV_QUANT_GROUP_SIZE


class PagedKVStorage:
    """Per-layer K/V pools for ``num_blocks`` blocks of ``block_size`` tokens; ``bits`` (8 or
    4) quantizes them (``dtype`` is then ignored)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, preallocate: bool = False,
                 dtype: Optional[mx.Dtype] = None, bits: Optional[int] = None) -> None:
        if bits not in (None, 4, 8):
            raise ValueError(f"quantized KV blocks take 8 or 4 bits, not {bits}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.dtype = None if bits else dtype  # of the arrays; None: the model's K/V dtype
        self.bits = bits
        self.group_size = KV_QUANT_GROUP_SIZE
        self.compute_dtype: Optional[mx.Dtype] = None  # the model's K/V dtype, known at the first write
        self.keys: list[Optional[mx.array]] = [None] * num_layers
        self.values: list[Optional[mx.array]] = [None] * num_layers
        # Quantized blocks: per layer (key_scales, key_biases, value_scales, value_biases).
        self.scales: list[Optional[list[mx.array]]] = [None] * num_layers
        self._blocks = num_blocks if preallocate else 0  # blocks the arrays hold (or will, once created)

    def layer_arrays(self, layer: int) -> list[mx.array]:
        """Every array of ``layer`` (keys, values, then a quantized layer's scales and
        biases), in a fixed order; empty before its first write."""
        if self.keys[layer] is None:
            return []
        return [self.keys[layer], self.values[layer], *(self.scales[layer] or [])]  # type: ignore[list-item]

    def _set_layer_arrays(self, layer: int, arrays: list[mx.array]) -> None:
        self.keys[layer], self.values[layer] = arrays[0], arrays[1]
        if self.bits:
            self.scales[layer] = list(arrays[2:])

    def arrays(self) -> list[mx.array]:
        """Every array the storage holds (what a step's evaluation waits for)."""
        return [a for layer in range(self.num_layers) for a in self.layer_arrays(layer)]

    def set_arrays(self, arrays: list[mx.array]) -> None:
        """Replace every array (as :meth:`arrays` lists them) by ``arrays``, of the same shapes."""
        at = 0
        for layer in range(self.num_layers):
            n = len(self.layer_arrays(layer))
            if n:
                self._set_layer_arrays(layer, list(arrays[at : at + n]))
                at += n
        if at != len(arrays):
            raise ValueError(f"{len(arrays)} arrays for storage holding {at}")

    def scratch(self, blocks: int) -> "PagedKVStorage":
        """A storage like this one (layers, block size, dtypes, quantization) whose arrays hold
        ``blocks`` blocks of zeros: where a pass can be tried without touching these arrays."""
        twin = PagedKVStorage(self.num_layers, blocks, self.block_size, preallocate=True, dtype=self.dtype, bits=self.bits)
        twin.compute_dtype = self.compute_dtype
        for layer in range(self.num_layers):
            if self.keys[layer] is not None:
                twin._create_layer(layer, self.layer_arrays(layer))
        return twin

    @property
    def physical_blocks(self) -> int:
        """Blocks the arrays hold now (or will hold when created)."""
        return self._blocks

    @property
    def nbytes(self) -> int:
        """Bytes the K and V arrays hold."""
        return sum(a.nbytes for a in self.arrays())

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
        for layer in range(self.num_layers):
            grown = []
            for a in self.layer_arrays(layer):
                grown.append(mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)]))
                mx.eval(grown[-1])  # now, so one array's old copy at most is held beside its new one
            if grown:
                self._set_layer_arrays(layer, grown)
        self._blocks = target

    def check(self, highest_slot: int) -> None:
        """Raise unless ``highest_slot`` lies in the arrays (MLX's scatters and gathers do
        not check their indices: one past the end would corrupt memory)."""
        if highest_slot >= self._blocks * self.block_size:
            raise IndexError(f"KV slot {highest_slot} is past the {self._blocks} blocks reserved")

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Put ``keys`` / ``values`` (``(n, kv_heads, head_dim)``) at ``slots`` (``(n,)``)."""
        self.compute_dtype = keys.dtype
        if self.bits:
            parts = [*self._quantize(keys), *self._quantize(values)]  # codes, scales, biases of K, then V
            new = [parts[0], parts[3], parts[1], parts[2], parts[4], parts[5]]
        else:
            new = [keys.astype(self.dtype or keys.dtype), values.astype(self.dtype or values.dtype)]
        self._put(layer, slots, new)

    def _put(self, layer: int, slots: mx.array, parts: list[mx.array]) -> None:
        """Scatter ``parts`` (one per :meth:`layer_arrays` entry) at ``slots``; a layer's arrays
        are created at its first write, shaped as ``parts`` and as large as reserved."""
        if self.keys[layer] is None:
            self._create_layer(layer, parts)
        for pool, part in zip(self.layer_arrays(layer), parts):
            pool[slots] = part.astype(pool.dtype)

    def _create_layer(self, layer: int, like: list[mx.array]) -> None:
        """``layer``'s arrays, zeros as large as reserved, each shaped (past its first axis)
        and typed as its twin in ``like``."""
        size = self._blocks * self.block_size
        self._set_layer_arrays(layer, [mx.zeros((size, *a.shape[1:]), a.dtype) for a in like])

    def block_slots(self, blocks: list[int]) -> mx.array:
        """The slots of ``blocks``, in order (``block_size`` each), checked to lie in the arrays."""
        bs = self.block_size
        self.check(max(blocks) * bs + bs - 1)
        return mx.array([b * bs + i for b in blocks for i in range(bs)], dtype=mx.int32)

    def _quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if x.shape[-1] % self.group_size:
            raise ValueError(f"quantized KV blocks need a head size divisible by {self.group_size}, not {x.shape[-1]}")
        return mx.quantize(x.astype(SCALES_DTYPE), group_size=self.group_size, bits=self.bits)

    def written_in_place(self, layer: int, by: mx.array) -> None:
        """``layer``'s arrays were written in place by the op computing ``by`` (the fused
        attention step): later readers of them wait for it."""
        self._set_layer_arrays(layer, mx.depends(self.layer_arrays(layer), [by]))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``source -> destination`` in every layer (copy on write)."""
        if not pairs or self.keys[0] is None:
            return
        src, dst = self.block_slots([s for s, _ in pairs]), self.block_slots([d for _, d in pairs])
        arrays = self.arrays()
        taken = [a[src] for a in arrays]
        # Gathered first: a pool its own write also reads cannot be written in place (MLX then
        # copies the whole array to write a few slots: every layer's pools, at every copy).
        mx.eval(taken)
        for a, t in zip(arrays, taken):
            a[dst] = t

    def saved_blocks(self, saves: list[tuple[int, bytes]]) -> list[tuple[bytes, BlockData]]:
        """Copies of the K/V of each ``(block, name)`` of ``saves`` in every layer (each layer's
        :meth:`layer_arrays`, in order, ``(block_size, ...)`` each), for the disk tier:
        ``(name, data)``. bfloat16 arrays come as their uint16 bits (NumPy has no bfloat16)."""
        if not saves or self.keys[0] is None:
            return []
        bs, idx = self.block_size, self.block_slots([b for b, _ in saves])
        taken = [a[idx] for layer in range(self.num_layers) for a in self.layer_arrays(layer)]
        mx.eval(taken)  # gathered copies: nothing keeps the pools from being written in place
        dtypes = [str(a.dtype).rsplit(".", 1)[-1] for a in taken]
        host = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in taken]
        return [(name, BlockData(dtypes, [a[k * bs : (k + 1) * bs] for a in host])) for k, (_, name) in enumerate(saves)]

    def load_blocks(self, loads: list[tuple[int, BlockData]]) -> None:
        """Write each ``(block, data)`` of ``loads`` (as :meth:`saved_blocks` gave them) into
        its block; arrays not yet created are created from the data's shapes."""
        idx, first = self.block_slots([b for b, _ in loads]), loads[0][1]
        per_layer = len(first.arrays) // self.num_layers
        for layer in range(self.num_layers):
            parts = []
            for i in range(layer * per_layer, (layer + 1) * per_layer):
                part = mx.array(np.concatenate([data.arrays[i] for _, data in loads]))
                dtype = getattr(mx, first.dtypes[i])
                parts.append(part.view(mx.bfloat16) if dtype == mx.bfloat16 else part.astype(dtype))
            self._put(layer, idx, parts)

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K and V at ``slots`` (any shape ``s``): arrays of shape ``(*s, kv_heads, head_dim)``,
        in the model's dtype."""
        return self._read(layer, lambda a: a[slots])

    def read_heads(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K and V at ``slots`` (shape ``(..., S)``) head by head: ``(..., kv_heads, S,
        head_dim)`` as attention takes them, each head's ``S`` tokens one contiguous matrix.
        (:meth:`read`'s values with its tokens and heads axes swapped, gathered in that order:
        MLX's CPU attention over a swapped view of :meth:`read`'s result copies it again,
        head by head, ~3x the attention's own time at 32 rows.)"""
        k, v = self._read(layer, lambda a: a.swapaxes(0, 1)[:, slots])  # (kv_heads, ..., S, D)
        return mx.moveaxis(k, 0, -3), mx.moveaxis(v, 0, -3)

    def _read(self, layer: int, gather: Callable[[mx.array], mx.array]) -> tuple[mx.array, mx.array]:
        """K and V of ``layer`` taken from its arrays by ``gather``, in the model's dtype."""
        k, v = gather(self.keys[layer]), gather(self.values[layer])  # type: ignore[arg-type]
        if self.bits:
            # In the model's dtype (float32 on the CPU): the values the CPU kernel dequantizes, not their float16 roundings.
            dtype = self.compute_dtype or SCALES_DTYPE
            ks, kb, vs, vb = (gather(a).astype(dtype) for a in self.scales[layer])  # type: ignore[union-attr]
            k = mx.dequantize(k, ks, kb, group_size=self.group_size, bits=self.bits)
            v = mx.dequantize(v, vs, vb, group_size=self.group_size, bits=self.bits)
        if self.compute_dtype is not None and k.dtype != self.compute_dtype:
            k, v = k.astype(self.compute_dtype), v.astype(self.compute_dtype)
        return k, v
