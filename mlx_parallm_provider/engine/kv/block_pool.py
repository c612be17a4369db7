"""A pool of KV blocks: which are free, and how many holders each used block has.

Block 0 is never handed out: it is the null block that padding positions write to and that
padded block-table entries point at (vLLM keeps one the same way). Free blocks are handed
out lowest id first, so the arrays behind the pool only need to be as large as the highest
block in use (:mod:`.storage` grows them on demand).
"""

from __future__ import annotations

import heapq
from typing import Iterable

NULL_BLOCK = 0


class BlockPool:
    """``num_blocks`` blocks (block 0 reserved), reference-counted."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(1, num_blocks))  # a heap: lowest id first
        self._refs = [0] * num_blocks

    @property
    def num_usable(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, each with one holder; ValueError if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"{n} KV blocks wanted, {len(self._free)} free")
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each of ``blocks`` (a prefix mapped into another table)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not in use")
            self._refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each of ``blocks``; a block nobody holds is free again."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is released more often than it was held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)

    def refs(self, block: int) -> int:
        """How many tables hold ``block``."""
        return self._refs[block]

    def high_water(self) -> int:
        """One more than the highest block id in use (0 when none is)."""
        for b in range(self.num_blocks - 1, 0, -1):
            if self._refs[b]:
                return b + 1
        return 0
