"""Per-request block tables over a :class:`~.block_pool.BlockPool`: the one owner of who
holds which KV memory. Pure bookkeeping (nano-vllm's ``BlockManager``, vLLM v1's
``KVCacheManager`` in miniature); the arrays live in :mod:`.storage`.

The scheduler asks :meth:`KVCacheManager.can_hold` before admitting a request and before a
step grows its rows, and preempts (frees a request's blocks with :meth:`free`) when the
pool runs out; the runner reads :meth:`table` to know where each row's tokens are.
"""

from __future__ import annotations

from typing import Hashable

from .block_pool import BlockPool


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` KV entries."""
    return -(-tokens // block_size)


class KVCacheManager:
    """Block tables of the requests that hold KV, and the pool they draw on.

    Args:
        num_blocks: blocks in the pool, the null block included.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        self.num_preemptions = 0

    # -- questions --------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most KV entries the pool can hold (all requests together)."""
        return self.pool.num_usable * self.block_size

    def table(self, owner: Hashable) -> list[int]:
        """``owner``'s blocks, in token order (empty if it holds none)."""
        return self._tables.get(owner, [])

    def held_tokens(self, owner: Hashable) -> int:
        """How many KV entries ``owner``'s blocks have room for."""
        return len(self.table(owner)) * self.block_size

    def blocks_to_grow(self, owner: Hashable, tokens: int) -> int:
        """Blocks ``owner`` must add so that its table holds ``tokens`` entries."""
        return max(0, blocks_for(tokens, self.block_size) - len(self.table(owner)))

    def can_hold(self, wanted: dict[Hashable, int]) -> bool:
        """Whether every ``owner -> tokens`` in ``wanted`` can be held at once."""
        return sum(self.blocks_to_grow(o, n) for o, n in wanted.items()) <= self.pool.num_free

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` entries fits in the whole pool."""
        return blocks_for(tokens, self.block_size) <= self.pool.num_usable

    # -- changes ----------------------------------------------------------------------

    def grow(self, owner: Hashable, tokens: int) -> None:
        """Make ``owner``'s table hold ``tokens`` entries (ValueError if blocks run out)."""
        n = self.blocks_to_grow(owner, tokens)
        if n:
            self._tables.setdefault(owner, []).extend(self.pool.allocate(n))

    def free(self, owner: Hashable) -> int:
        """Release every block ``owner`` holds; returns how many."""
        blocks = self._tables.pop(owner, [])
        self.pool.release(blocks)
        return len(blocks)

    def preempted(self, owner: Hashable) -> None:
        """``owner`` gives its blocks back to be recomputed later (counted)."""
        self.free(owner)
        self.num_preemptions += 1

    # -- what metrics show ------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Blocks total / free / used, the block size, usage (used / total) and preemptions."""
        total, free = self.pool.num_usable, self.pool.num_free
        return {
            "kv_block_size": self.block_size,
            "kv_blocks_total": total,
            "kv_blocks_free": free,
            "kv_blocks_used": total - free,
            "kv_cache_usage_perc": (total - free) / total if total else 0.0,
            "num_preemptions": self.num_preemptions,
        }
