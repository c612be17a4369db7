"""A store of prompt KV across requests, keyed by token ids (automatic prefix caching).

The shape is SGLang's RadixAttention: a radix tree whose edges are runs of token ids and
whose nodes hold the K and V of exactly those tokens (every layer, one row). A lookup walks
the tree and returns how many leading tokens of a prompt are cached; a fetch concatenates
the KV along that path. Inserting a sequence splits a node where the new sequence
diverges and stores only the tokens not already present, so a prefix shared by many
requests is held once. The store is bounded in bytes; past the bound it evicts the least
recently used leaves (a parent is only evicted after its children, so every cached path
stays complete), taken from a heap of leaves as SGLang's ``RadixCache`` keeps one, so an
eviction costs O(log n), not a walk of the whole tree.

Rows that use a cached prefix either copy its KV into their own or (a prefix shared by
several rows, :mod:`.shared_kv`) hold a view of the stored arrays. MLX arrays are immutable
and reference-counted, so eviction (or a split) never invalidates a running row: it only
drops the store's reference, and the memory goes back when the last row using it leaves.
Only the worker thread touches the tree; :meth:`PrefixCache.stats` may be read from any
thread (plain ints).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Optional, Sequence

import mlx.core as mx

from .prefix_match import common_prefix_len

LayerKV = tuple[mx.array, mx.array]
"""One layer's (keys, values), each shaped ``[1, kv_heads, tokens, head_dim]``."""

KVSource = Callable[[int, int], list[LayerKV]]
"""``source(start, end)``: every layer's KV of the tokens ``start:end`` of a sequence."""


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last_used", "nbytes")

    def __init__(self, tokens: tuple[int, ...], kv: list[LayerKV], parent: Optional["_Node"]) -> None:
        self.tokens = tokens
        self.kv = kv
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = 0
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in kv)


def _slice(kv: list[LayerKV], start: int, end: Optional[int] = None) -> list[LayerKV]:
    """A copy of tokens ``start:end``, evaluated now: neither a view nor a pending graph
    may keep the larger source (a whole batch cache) alive."""
    out = [(mx.contiguous(k[:, :, start:end]), mx.contiguous(v[:, :, start:end])) for k, v in kv]
    mx.eval(out)
    return out


def kv_range(pieces: list[list[LayerKV]], start: int, end: int) -> list[LayerKV]:
    """Every layer's KV of tokens ``start:end`` of the run that ``pieces`` (from
    :meth:`PrefixCache.fetch_pieces`) hold, reading only the pieces that overlap it; a
    range inside one piece is a view of it, not a copy."""
    parts: list[list[LayerKV]] = []
    at = 0
    for piece in pieces:
        n = piece[0][0].shape[2]
        a, b = max(start - at, 0), min(end - at, n)
        if a < b:
            parts.append(piece if (a, b) == (0, n) else [(k[:, :, a:b], v[:, :, a:b]) for k, v in piece])
        at += n
    if len(parts) == 1:
        return parts[0]
    return [
        (mx.concatenate([p[layer][0] for p in parts], axis=2), mx.concatenate([p[layer][1] for p in parts], axis=2))
        for layer in range(len(parts[0]))
    ]


class PrefixCache:
    """Radix tree of token ids -> KV, bounded by ``max_bytes`` with LRU eviction of leaves.

    Args:
        max_bytes: most bytes of K and V the store keeps.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._root = _Node((), [], None)
        self._tick = 0
        self.nbytes = 0
        self.num_tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        # (last_used, seq, node) for each leaf; an entry whose node is no longer a leaf of
        # the tree, or was used since, is stale and skipped when popped.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._seq = itertools.count()

    # -- lookups -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` have their KV stored (no side effects)."""
        return sum(n for _, n in self._walk(tokens))

    def fetch(self, tokens: Sequence[int], n: int) -> list[LayerKV]:
        """Every layer's KV of ``tokens[:n]`` (``n`` at most :meth:`match`), as new arrays
        the caller owns; marks the path as recently used."""
        pieces = self.fetch_pieces(tokens, n)
        if len(pieces) == 1:
            return [(mx.contiguous(k), mx.contiguous(v)) for k, v in pieces[0]]
        return kv_range(pieces, 0, n)

    def fetch_pieces(self, tokens: Sequence[int], n: int) -> list[list[LayerKV]]:
        """The KV of ``tokens[:n]`` as the stored pieces along its path (views of the
        store's arrays, nothing copied: see :func:`kv_range`); marks the path as used."""
        pieces: list[list[LayerKV]] = []
        got = 0
        self._tick += 1
        for node, used in self._walk(tokens[:n]):
            node.last_used = self._tick
            if not node.children:
                self._push_leaf(node)
            pieces.append(node.kv if used == len(node.tokens) else [(k[:, :, :used], v[:, :, :used]) for k, v in node.kv])
            got += used
        if got < n:
            raise KeyError(f"only {got} of the {n} requested tokens are cached")
        return pieces

    # -- updates -----------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], source: KVSource, bytes_per_token: int) -> int:
        """Store the KV of ``tokens``, asking ``source`` only for the part not yet stored.

        Returns how many tokens were added (0 when all were there, or when the new part
        alone would exceed ``max_bytes``). Evicts least recently used leaves to stay within
        the bound, a node on the path just inserted only when nothing else is left.
        """
        tokens = tuple(tokens)
        self._tick += 1
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            shared = common_prefix_len(child.tokens, tokens[depth:])
            if shared < len(child.tokens):
                child = self._split(child, shared)
            child.last_used = self._tick
            if not child.children:
                self._push_leaf(child)
            node, depth = child, depth + shared
        new = len(tokens) - depth
        if new == 0 or new * bytes_per_token > self.max_bytes:
            return 0
        leaf = _Node(tokens[depth:], _slice(source(depth, len(tokens)), 0), node)
        leaf.last_used = self._tick
        node.children[tokens[depth]] = leaf
        self._push_leaf(leaf)
        self.nbytes += leaf.nbytes
        self.num_tokens += new
        self._evict(protect=leaf)
        return new

    def clear(self) -> None:
        """Drop everything stored."""
        self._root = _Node((), [], None)
        self.nbytes = self.num_tokens = 0
        self._leaves = []

    def stats(self) -> dict[str, int]:
        """``{"cached_bytes", "cached_tokens_stored", "evictions", "evicted_tokens", "max_bytes"}``."""
        return {
            "cached_bytes": self.nbytes,
            "cached_tokens_stored": self.num_tokens,
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "max_bytes": self.max_bytes,
        }

    # -- internals ---------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]):
        """Yield ``(node, tokens of it matched)`` along the longest cached prefix."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                return
            shared = common_prefix_len(child.tokens, tokens[depth : depth + len(child.tokens)])
            yield child, shared
            if shared < len(child.tokens):
                return
            node, depth = child, depth + shared

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; returns the new upper part (its parent's child)."""
        upper = _Node(node.tokens[:at], _slice(node.kv, 0, at), node.parent)
        upper.last_used = node.last_used
        assert node.parent is not None
        node.parent.children[node.tokens[0]] = upper
        old_bytes = node.nbytes
        node.tokens, node.kv, node.parent = node.tokens[at:], _slice(node.kv, at), upper
        node.nbytes = sum(k.nbytes + v.nbytes for k, v in node.kv)
        upper.children[node.tokens[0]] = node
        self.nbytes += upper.nbytes + node.nbytes - old_bytes
        return upper

    def _push_leaf(self, node: _Node) -> None:
        if len(self._leaves) > 4 * (self.num_tokens + 16):  # mostly stale: rebuild from the tree
            self._leaves = [(n.last_used, next(self._seq), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._leaves)
        heapq.heappush(self._leaves, (node.last_used, next(self._seq), node))

    def _is_leaf(self, node: _Node, stamp: int) -> bool:
        parent = node.parent
        return (not node.children and node.last_used == stamp and parent is not None
                and parent.children.get(node.tokens[0]) is node)

    def _evict(self, protect: _Node) -> None:
        """Drop least recently used leaves until within ``max_bytes``; leaves on the path to
        ``protect`` only when no other leaf is left."""
        keep = set()
        node: Optional[_Node] = protect
        while node is not None:
            keep.add(id(node))
            node = node.parent
        spared: list[tuple[int, int, _Node]] = []
        while self.nbytes > self.max_bytes:
            if self._leaves:
                entry = heapq.heappop(self._leaves)
                if not self._is_leaf(entry[2], entry[0]):
                    continue
                if id(entry[2]) in keep:
                    spared.append(entry)
                    continue
            elif spared:
                entry = spared.pop(0)
            else:
                return
            victim = entry[2]
            assert victim.parent is not None
            parent = victim.parent
            del parent.children[victim.tokens[0]]
            victim.parent = None
            self.nbytes -= victim.nbytes
            self.num_tokens -= len(victim.tokens)
            self.evictions += 1
            self.evicted_tokens += len(victim.tokens)
            if not parent.children and parent is not self._root:
                self._push_leaf(parent)
        for entry in spared:
            heapq.heappush(self._leaves, entry)

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
