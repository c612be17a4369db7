"""KV memory in fixed-size blocks, owned in one place.

* :mod:`.block_pool`: which blocks are free, reference counts (pure bookkeeping).
* :mod:`.manager`: per-request block tables over the pool; what the scheduler asks before
  admitting, growing or preempting a request (pure bookkeeping, no MLX).
* :mod:`.groups`: which layers share a block table (layers of one sliding window, or all).
* :mod:`.storage`: the blocks' K and V arrays, one per storage slot (a layer of a group; MLX).
* :mod:`.paged_cache`: the per-layer cache object a model sees for one forward pass: it
  writes the step's new K/V into blocks and attends through the rows' block tables.
"""

from .block_pool import BlockPool
from .manager import KVCacheManager, PrefixHit, blocks_for

__all__ = ["BlockPool", "KVCacheManager", "PrefixHit", "blocks_for"]
