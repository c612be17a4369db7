"""A batch KV cache that holds a prefix shared by several rows once (per layer).

Rows admitted together with the same cached prefix (an agent's system prompt and tool
schemas, ``n > 1`` copies of one prompt) reference ONE copy of that prefix's K and V; each
row's own tokens live in a left-padded mlx-lm ``BatchKVCache`` (the "suffix"). Attention is
cascade attention (Hydragen; FlashInfer's cascade, :func:`.cascade.cascade_attention`): the prefix part is one matmul per KV
head for every query of every row of the group, each row's suffix part is attended with
its mask, and the two are merged by log-sum-exp. Rows with no shared prefix are plain
suffix rows; a batch with no shared prefix at all gets the model's backend's plain
``dense_attention``.

The cache keeps mlx-lm's ``BatchKVCache`` operations (``filter``, ``extend``, ``prepare``,
``finalize``, ``make_mask``, ``update_and_fetch``), so the worker's continuous batching
treats it like any batch cache. ``offset`` is each row's true position (prefix + suffix),
which is what RoPE needs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache

from .. import mlx_lm_compat
from ..models.backends import MLXOps
from .cascade import SharedPrefix, cascade_attention

_MLX_OPS = MLXOps()


class SharedPrefixBatchCache:
    """One layer of a batch cache: per-row suffix KV (left-padded) plus shared prefixes.

    Args:
        suffix: the rows' own KV.
        prefixes: for each row, the prefix it shares (or None).
    """

    def __init__(self, suffix: BatchKVCache, prefixes: Optional[list[Optional[SharedPrefix]]] = None) -> None:
        self.suffix = suffix
        self.prefixes = prefixes if prefixes is not None else [None] * suffix.left_padding.shape[0]
        self._groups: Optional[list[tuple[SharedPrefix, mx.array]]] = None
        self._lengths: Optional[mx.array] = None  # each row's prefix length, with _groups
        # with _groups: each row's group (-1: none) and the groups' (keys, values), for the decode kernel
        self._prefix_index: tuple[mx.array, list[tuple[mx.array, mx.array]]] = (mx.array([], dtype=mx.int32), [])

    @classmethod
    def fresh(cls, left_padding: list[int]) -> "SharedPrefixBatchCache":
        """No KV yet, no shared prefix (a fresh left-padded prefill batch)."""
        return cls(BatchKVCache(left_padding))

    # -- what the model reads -------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        if not self.groups():
            return self.suffix.offset
        if self._lengths is None:
            self._lengths = mx.array([0 if p is None else p.length for p in self.prefixes])
        return self.suffix.offset + self._lengths

    @property
    def left_padding(self) -> mx.array:
        return self.suffix.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.suffix.update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return self.suffix.make_mask(N, return_array=return_array, **kwargs)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any],
               backend: Optional[MLXOps] = None) -> mx.array:
        """Attention of ``queries`` over each row's shared prefix and its own ``keys``, by
        ``backend`` (the model's; None: MLX's ops)."""
        backend = backend or _MLX_OPS
        groups = self.groups()
        if not groups:
            return backend.dense_attention(queries, keys, values, scale=scale, mask=mask)
        if queries.shape[2] == 1:  # decoding: one fused op where the backend has a kernel
            index, prefixes = self._prefix_index
            out = backend.decode_attention(queries, keys, values, scale, mask, index, prefixes)
            if out is not None:
                return out
        mask = _bool_mask(mask, queries.shape[2], keys.shape[2])
        return cascade_attention(queries, keys, values, scale, mask, groups, exp=backend.exp)

    def groups(self) -> list[tuple[SharedPrefix, mx.array]]:
        """``(prefix, row indices)`` for each prefix shared by rows of this batch."""
        if self._groups is None:
            rows: dict[int, tuple[SharedPrefix, list[int]]] = {}
            for i, p in enumerate(self.prefixes):
                if p is not None:
                    rows.setdefault(id(p), (p, []))[1].append(i)
            self._groups = [(p, mx.array(idx)) for p, idx in rows.values()]
            self._lengths = None
            index = [-1] * len(self.prefixes)
            for g, (_, idx) in enumerate(rows.values()):
                for i in idx:
                    index[i] = g
            self._prefix_index = (mx.array(index, dtype=mx.int32), [(p.keys, p.values) for p, _ in rows.values()])
        return self._groups

    # -- batch operations (mlx-lm's BatchKVCache interface) -------------------------------

    @property
    def state(self) -> tuple:
        return (*self.suffix.state, [(p.keys, p.values) for p, _ in self.groups()])

    def size(self) -> int:
        return self.suffix.size()

    def empty(self) -> bool:
        return self.suffix.empty()

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes + sum(p.keys.nbytes + p.values.nbytes for p, _ in self.groups())

    def prepare(self, **kwargs: Any) -> None:
        self.suffix.prepare(**kwargs)

    def finalize(self) -> None:
        self.suffix.finalize()

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the given rows (in that order)."""
        self.suffix.filter(batch_indices)
        self.prefixes = [self.prefixes[i] for i in list(batch_indices)]
        self._groups = None

    def extend(self, other: Any) -> None:
        """Append ``other``'s rows. A prefix with the same tokens as one already here is
        replaced by the one here, so both sets of rows share a single copy."""
        if not isinstance(other, SharedPrefixBatchCache):
            other = SharedPrefixBatchCache(other)
        self.suffix.extend(other.suffix)
        mine = {p.key: p for p in self.prefixes if p is not None}
        self.prefixes = self.prefixes + [None if p is None else mine.get(p.key, p) for p in other.prefixes]
        self._groups = None

    def adopt(self, rows: dict[int, SharedPrefix]) -> None:
        """Let plain rows use a shared prefix (``rows``: row -> prefix) whose tokens their
        own KV starts with: those tokens become left padding of the row (the same values,
        now read from the shared copy), and the columns every row pads are cut, so a row
        that computed the prefix itself stops holding a copy of it."""
        grow = [0] * len(self.prefixes)
        for i, prefix in rows.items():
            self.prefixes[i] = prefix
            grow[i] = prefix.length
        if not any(grow):
            return
        s, g = self.suffix, mx.array(grow)
        s.left_padding, s.offset = s.left_padding + g, s.offset - g
        self._groups = None
        cut = min(s.left_padding.tolist())
        if cut > 0 and s.keys is not None:
            s.keys, s.values = mx.contiguous(s.keys[..., cut:, :]), mx.contiguous(s.values[..., cut:, :])
            mlx_lm_compat.drop_leading_columns(s, cut)
            s.left_padding = s.left_padding - cut

    def row_kv(self, i: int, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Row ``i``'s K and V of its sequence's tokens ``start:end`` (prefix, then own)."""
        prefix = self.prefixes[i]
        plen = 0 if prefix is None else prefix.length
        parts = []
        if start < plen:
            parts.append((prefix.keys[:, :, start : min(end, plen)], prefix.values[:, :, start : min(end, plen)]))  # type: ignore[union-attr]
        if end > plen:
            pad = int(self.suffix.left_padding[i].item())
            a, b = pad + max(start - plen, 0), pad + end - plen
            parts.append((self.suffix.keys[i : i + 1, :, a:b], self.suffix.values[i : i + 1, :, a:b]))
        if len(parts) == 1:
            return parts[0]
        return mx.concatenate([parts[0][0], parts[1][0]], axis=2), mx.concatenate([parts[0][1], parts[1][1]], axis=2)

    def row_length(self, i: int) -> int:
        """How many tokens of row ``i``'s sequence have KV here."""
        prefix = self.prefixes[i]
        own = self.suffix.size() - int(self.suffix.left_padding[i].item())
        return own + (0 if prefix is None else prefix.length)


def _bool_mask(mask: Optional[Any], L: int, S: int) -> Optional[mx.array]:
    """mlx-lm's mask argument as a boolean array (True = attend), or None."""
    if mask is None:
        return None
    if isinstance(mask, str):
        return create_causal_mask(L, S - L)
    if mask.dtype != mx.bool_:
        return mask > -1e30  # an additive mask: -inf (or a huge negative) where masked
    return mask
