"""A pool of KV blocks: which are free, how many holders each used block has, and which
hold a cached prefix.

Block 0 is never handed out: it is the null block that padding positions write to and that
padded block-table entries point at (vLLM keeps one the same way). Free blocks are handed
out lowest id first, so the arrays behind the pool only need to be as large as the highest
block in use (:mod:`.storage` grows them on demand).

Prefix caching (vLLM's automatic prefix caching): a block can be given a ``key``, ``(parent,
tokens)``: the name of the prefix before it and the tokens it holds (all of a full block,
the first few of a partial one; see :mod:`.manager`). Blocks are also listed by parent, so a
prompt can find the block after its last whole match that shares most of its next tokens. A keyed block nobody holds any more is
not free but *cached*: it waits in a least-recently-used queue, a later request with the
same prefix takes it back (:meth:`share`), and it is reused for other KV only when no free
block is left (or past ``max_cached``), so the prefix store and the running rows share one
budget. While the arrays behind the pool are smaller than the pool (:attr:`BlockPool.physical`),
the arrays grow for new KV as long as the store names fewer than ``max_cached`` blocks, and
once it names that many its least recently used blocks are reused first: the arrays hold the
running rows' KV plus at most the store's budget of cached prefixes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Hashable, Iterable, Optional

NULL_BLOCK = 0


class BlockPool:
    """``num_blocks`` blocks (block 0 reserved), reference-counted, full ones keyed.

    Args:
        num_blocks: blocks in the pool, the null block included.
        max_cached: the most keyed blocks kept (held or not); None: as many as fit.
    """

    def __init__(self, num_blocks: int, max_cached: Optional[int] = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.max_cached = max_cached
        self._free = list(range(1, num_blocks))  # a heap: lowest id first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self._children: dict[Hashable, set[int]] = {}  # parent -> keyed blocks after it
        self._idle: OrderedDict[int, None] = OrderedDict()  # keyed, held by nobody: least recently used first
        self._highest = 0  # the highest block id ever handed out
        self.physical = num_blocks  # blocks the arrays hold now: past them, cached blocks are reused first once the store is full
        self.evictions = 0

    @property
    def num_usable(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and held by nobody)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks some table holds."""
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Keyed blocks (held or not)."""
        return len(self._key_of)

    @property
    def store_full(self) -> bool:
        """The prefix store names ``max_cached`` blocks (never with no bound)."""
        return self.max_cached is not None and len(self._key_of) >= self.max_cached

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each with one holder: free ones within the arrays' present size
        (:attr:`physical`) first; then, while the prefix store has room (:attr:`store_full`),
        free ones past it (the arrays grow), else the least recently used cached ones (their
        keys forgotten) before those; ValueError if fewer are left."""
        if n > self.num_free:
            raise ValueError(f"{n} KV blocks wanted, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free and (self._free[0] < self.physical or not self._idle or not self.store_full):
                b = heapq.heappop(self._free)
            else:
                b, _ = self._idle.popitem(last=False)
                self._forget(b)
            self._refs[b] = 1
            self._highest = max(self._highest, b)
            blocks.append(b)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each of ``blocks`` (a cached prefix mapped into a table)."""
        for b in blocks:
            if self._refs[b] == 0:
                if b not in self._idle:
                    raise ValueError(f"block {b} is neither in use nor cached")
                del self._idle[b]
            self._refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each of ``blocks``; a block nobody holds is free again, or
        cached if it has a key."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is released more often than it was held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._idle[b] = None
                else:
                    heapq.heappush(self._free, b)

    def refs(self, block: int) -> int:
        """How many tables hold ``block``."""
        return self._refs[block]

    # -- keys (prefix caching) ----------------------------------------------------------

    def lookup(self, key: Hashable) -> Optional[int]:
        """The cached block with ``key``, or None."""
        return self._block_of.get(key)

    def children(self, parent: Hashable) -> list[tuple[int, tuple[int, ...]]]:
        """``(block, tokens)`` of the keyed blocks that follow the prefix named ``parent``."""
        return [(b, self._key_of[b][1]) for b in self._children.get(parent, ())]  # type: ignore[index]

    def set_key(self, block: int, key: tuple[Hashable, tuple[int, ...]]) -> bool:
        """Name a held block by ``key`` (``(parent, tokens)``) so later requests can find it;
        a block named by fewer of the same tokens is renamed (it filled up). False (and no
        change) when another block has that key, or the cache is full of held blocks."""
        old = self._key_of.get(block)
        if old is not None:
            if old == key or old[0] != key[0] or key[1][: len(old[1])] != old[1] or key in self._block_of:  # type: ignore[index]
                return False
            self._unlink(block)
        elif key in self._block_of:
            return False
        if self.max_cached is not None and len(self._key_of) >= self.max_cached:
            if not self._idle:
                return False
            old, _ = self._idle.popitem(last=False)
            self._forget(old)
            heapq.heappush(self._free, old)
        self._key_of[block] = key
        self._block_of[key] = block
        self._children.setdefault(key[0], set()).add(block)
        return True

    def touch(self, blocks: Iterable[int]) -> None:
        """Mark cached blocks as just used (they are evicted last)."""
        for b in blocks:
            if b in self._idle:
                self._idle.move_to_end(b)

    def _forget(self, block: int) -> None:
        if block in self._key_of:
            self._unlink(block)
            self.evictions += 1

    def _unlink(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        siblings = self._children[key[0]]  # type: ignore[index]
        siblings.discard(block)
        if not siblings:
            del self._children[key[0]]  # type: ignore[index]

    def high_water(self) -> int:
        """One more than the highest block id ever handed out (0 before the first): the
        arrays behind the pool must hold that many blocks."""
        return self._highest + 1 if self._highest else 0
