"""The prefix store's blocks to and from its disk tier (:class:`.disk_tier.DiskKVTier`):
pure bookkeeping over the block pool, the files' reading and writing being the tier's.

Whole blocks newly named in the pool are queued to be saved (:meth:`DiskPrefixes.named`),
handed to the runner with the step (:meth:`DiskPrefixes.take`), which copies their arrays out
before anything is written, then to the tier's writer (:meth:`DiskPrefixes.to_disk`).
:meth:`DiskPrefixes.load_prefix` brings back the blocks of a prompt's prefix the pool lacks
but the tier holds: it takes blocks for them, names them as if computed here (cached, held by
nobody, so the pool's match finds them) and queues their data for the runner to write before
anything reads them. One group of layers only (no mix of sliding windows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

from .block_pool import BlockPool
from .disk_tier import BlockData, DiskKVTier

if TYPE_CHECKING:
    from .manager import KVCacheManager


class DiskPrefixes:
    """What goes between one engine's block pool and its disk tier."""

    def __init__(self, tier: DiskKVTier) -> None:
        self.tier = tier
        self.pending_saves: list[tuple[int, Hashable, bytes]] = []  # (block, its key, its disk name)
        self.pending_loads: list[tuple[int, BlockData]] = []  # blocks named from the disk, their data to write
        self.loaded_blocks = 0

    def named(self, tokens: Sequence[int], blocks: list[tuple[int, int, Hashable]], block_size: int) -> None:
        """``(index, block, key)``: whole blocks of ``tokens`` just named in the pool, to save."""
        names = self.tier.names(tokens, blocks[-1][0] + 1, block_size)
        self.pending_saves.extend((block, key, names[i]) for i, block, key in blocks)

    def take(self, pool: BlockPool) -> tuple[list[tuple[int, bytes]], list[tuple[int, BlockData]]]:
        """The step's saves (those blocks still named so: not reused since) and loads."""
        saves = [(b, name) for b, key, name in self.pending_saves if pool.lookup(key) == b]
        loads, self.pending_saves, self.pending_loads = self.pending_loads, [], []
        return saves, loads

    def to_disk(self, saved: list[tuple[bytes, BlockData]]) -> None:
        """Hand the blocks the runner copied out (a step's saves) to the tier's writer."""
        for name, data in saved:
            self.tier.save(name, data)

    def load_prefix(self, kv: "KVCacheManager", tokens: Sequence[int], limit: int) -> int:
        """Bring back the whole blocks of the longest prefix of ``tokens`` (at most ``limit``
        tokens) that follow what ``kv``'s pool names, as far as the tier holds them and the
        pool has blocks to spare (what ``tokens`` need past them kept free). Returns how many
        blocks were loaded."""
        pool, bs = kv.pool, kv.block_size
        whole = min(limit, len(tokens)) // bs
        keys = kv.block_keys(tokens, whole)
        held = []
        for key in keys:
            block = pool.lookup(key)
            if block is None:
                break
            held.append(block)
        start = len(held)
        rest = -(-(len(tokens) - whole * bs + 1) // bs)
        spare = pool.num_free - sum(pool.refs(b) == 0 for b in held) - rest - 1
        if start == whole or spare <= 0:
            return 0
        found = self.tier.load(self.tier.names(tokens, whole, bs)[start:], spare)
        if not found:
            return 0
        pool.share(held)  # (not reused for the blocks loaded now)
        loaded: list[int] = []
        try:
            for i, data in enumerate(found, start):
                block = pool.allocate(1)[0]
                if not pool.set_key(block, keys[i]):  # the store is full of held blocks
                    pool.release([block])
                    break
                loaded.append(block)
                self.pending_loads.append((block, data))
        finally:
            pool.release(loaded)
            pool.release(held)
        self.loaded_blocks += len(loaded)
        return len(loaded)
