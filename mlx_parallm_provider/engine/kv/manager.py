"""Per-request block tables over a :class:`~.block_pool.BlockPool`: the one owner of who
holds which KV memory, and the prefix cache on blocks. Pure bookkeeping (nano-vllm's
``BlockManager``, vLLM v1's ``KVCacheManager`` in miniature); the arrays live in
:mod:`.storage`.

The scheduler asks :meth:`KVCacheManager.can_hold` before admitting a request and before a
step grows its rows, and preempts (frees a request's blocks with :meth:`preempted`) when
the pool runs out; the runner reads :meth:`table` to know where each row's tokens are.

Prefix caching: a block is named by its tokens and the name of the prefix before it (so
equal names mean equal prefixes, as vLLM hashes blocks). :meth:`register` names the blocks
a request has computed (its last, partly filled one too); :meth:`match` finds the longest
run of whole named blocks a new prompt starts with, then the named block after them that
shares most of its next tokens; :meth:`grow` with that hit maps the whole blocks into the
request's table (shared, no copy) and gives it a copy of the last one (copy on write: the
request writes after the shared tokens), queued in :attr:`pending_copies` for the runner.

Sliding windows: where every layer attends to at most the last ``window`` tokens
(``max_kv_size``), :meth:`slide` releases a table's blocks that no later query can see; their
entries become the null block, so positions keep their place in the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from .block_pool import NULL_BLOCK, BlockPool


@dataclass(frozen=True)
class PrefixHit:
    """What the cache holds of a prompt: whole ``blocks`` to share, then (``copy_from``) a
    cached block whose first ``copy_tokens`` tokens come next, to be copied into a block
    of the request's own (it will write after them)."""

    blocks: list[int] = field(default_factory=list)
    copy_from: Optional[int] = None
    copy_tokens: int = 0
    block_size: int = 1

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.copy_tokens


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` KV entries."""
    return -(-tokens // block_size)


class KVCacheManager:
    """Block tables of the requests that hold KV, and the pool they draw on.

    Args:
        num_blocks: blocks in the pool, the null block included.
        block_size: tokens per block.
        max_cached_blocks: the most blocks the prefix cache names (None: no bound but the pool).
        window: the most recent tokens any layer attends to, where every layer has a window
            (None: some layer attends to every token, and no block is released early).
    """

    def __init__(self, num_blocks: int, block_size: int, max_cached_blocks: Optional[int] = None, window: Optional[int] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, max_cached_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        self._limits: dict[Hashable, int] = {}  # owner -> the most entries its table may come to hold
        self.num_preemptions = 0
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) blocks, sources held

    # -- questions --------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most KV entries the pool can hold (all requests together)."""
        return self.pool.num_usable * self.block_size

    def table(self, owner: Hashable) -> list[int]:
        """``owner``'s blocks, in token order (empty if it holds none)."""
        return self._tables.get(owner, [])

    def blocks_to_grow(self, owner: Hashable, tokens: int) -> int:
        """Blocks ``owner`` must add so that its table holds ``tokens`` entries."""
        return max(0, blocks_for(tokens, self.block_size) - len(self.table(owner)))

    def blocks_to_come(self) -> int:
        """Blocks the tables may still add before each reaches its limit (prompt +
        ``max_tokens``, given to :meth:`grow`): what the arrays may have to hold beyond the
        blocks in use for the requests holding blocks now."""
        return sum(max(0, blocks_for(limit, self.block_size) - len(self.table(o))) for o, limit in self._limits.items())

    def can_hold(self, wanted: dict[Hashable, int]) -> bool:
        """Whether every ``owner -> tokens`` in ``wanted`` can be held at once."""
        return sum(self.blocks_to_grow(o, n) for o, n in wanted.items()) <= self.pool.num_free

    def admission_cost(self, tokens: int, prefix: Optional[PrefixHit] = None) -> int:
        """Free blocks a new table of ``tokens`` entries starting with ``prefix`` takes: its
        own blocks, plus the cached blocks it shares (or holds to copy) that nobody holds
        now (they count as free until then)."""
        cost = blocks_for(tokens, self.block_size)
        if prefix is not None and prefix.tokens:
            cost -= len(prefix.blocks)
            cost += sum(self.pool.refs(b) == 0 for b in prefix.blocks)
            cost += prefix.copy_from is not None and self.pool.refs(prefix.copy_from) == 0
        return cost

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` entries fits in the whole pool."""
        return blocks_for(tokens, self.block_size) <= self.pool.num_usable

    def peak_tokens(self, prompt: int, total: int) -> int:
        """The most entries a request of a ``prompt`` and ``total`` tokens in all holds at once:
        ``total``, or with a window its prompt (given its blocks at admission) or a window's
        worth and the blocks it straddles, whichever is more."""
        if self.window is None:
            return total
        return min(total, max(prompt + 1, self.window + 2 * self.block_size))

    # -- prefix cache -----------------------------------------------------------------

    def _keys(self, tokens: Sequence[int], blocks: int) -> list[tuple[Hashable, tuple[int, ...]]]:
        """The names of the first ``blocks`` whole blocks of ``tokens``."""
        bs, keys, parent = self.block_size, [], 0
        for i in range(blocks):
            keys.append((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            parent = hash(keys[-1])
        return keys

    @staticmethod
    def _parent(keys: list[tuple[Hashable, tuple[int, ...]]]) -> Hashable:
        return hash(keys[-1]) if keys else 0

    def match(self, tokens: Sequence[int], limit: int) -> PrefixHit:
        """What the cache holds of the longest prefix of ``tokens``, at most ``limit``
        tokens of it (no side effects)."""
        bs, found = self.block_size, []
        keys = self._keys(tokens, min(limit, len(tokens)) // bs)
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            found.append(block)
        start = len(found) * bs
        room = min(limit, len(tokens)) - start
        best, best_len = None, 0
        if room > 0:
            nxt = tokens[start : start + min(room, bs)]
            for block, held in self.pool.children(self._parent(keys[: len(found)])):
                n = 0
                for a, b in zip(held, nxt):
                    if a != b:
                        break
                    n += 1
                if n > best_len:
                    best, best_len = block, n
        return PrefixHit(found, best, best_len, bs)

    def register(self, owner: Hashable, tokens: Sequence[int], computed: int) -> int:
        """Name ``owner``'s blocks holding its first ``computed`` tokens (``tokens[:computed]``),
        the last partly filled one too, so later prompts can share them; returns how many
        were named now."""
        table, bs = self.table(owner), self.block_size
        computed = min(computed, len(tokens), len(table) * bs)
        keys = self._keys(tokens, computed // bs)
        named = sum(self.pool.set_key(block, key) for block, key in zip(table, keys) if block != NULL_BLOCK)
        if computed % bs and table[len(keys)] != NULL_BLOCK:
            last = (self._parent(keys), tuple(tokens[len(keys) * bs : computed]))
            named += self.pool.set_key(table[len(keys)], last)
        return named

    # -- changes ----------------------------------------------------------------------

    def grow(self, owner: Hashable, tokens: int, prefix: Optional[PrefixHit] = None, limit: Optional[int] = None) -> None:
        """Make ``owner``'s table hold ``tokens`` entries (ValueError if blocks run out),
        starting a new table with a cached ``prefix``: its whole blocks shared, its last
        block copied into one of the owner's own (queued in :attr:`pending_copies`).
        ``limit``: the most entries the owner will ever hold (see :meth:`blocks_to_come`)."""
        if limit is not None:
            self._limits[owner] = limit
        if prefix is not None and prefix.tokens and owner not in self._tables:
            self.pool.share(prefix.blocks)
            self.pool.touch(prefix.blocks)
            table = self._tables[owner] = list(prefix.blocks)
            if prefix.copy_from is not None:
                self.pool.share([prefix.copy_from])  # held until copied
                table.extend(self.pool.allocate(1))
                self.pending_copies.append((prefix.copy_from, table[-1]))
        n = self.blocks_to_grow(owner, tokens)
        if n:
            self._tables.setdefault(owner, []).extend(self.pool.allocate(n))

    def fit(self, owner: Hashable, tokens: int) -> None:
        """Make ``owner``'s table hold exactly the blocks ``tokens`` entries need: grown, or
        its blocks past them released (rejected speculative tokens' KV, never cached)."""
        table = self._tables.get(owner, [])
        keep = blocks_for(tokens, self.block_size)
        if len(table) > keep:
            self.pool.release(reversed(table[keep:]))
            del table[keep:]
        else:
            self.grow(owner, tokens)

    def free(self, owner: Hashable) -> int:
        """Release every block ``owner`` holds (cached ones stay cached); returns how many."""
        blocks = [b for b in self._tables.pop(owner, []) if b != NULL_BLOCK]
        self._limits.pop(owner, None)
        self.pool.release(reversed(blocks))  # the prompt's first blocks are evicted last
        return len(blocks)

    def slide(self, owner: Hashable, position: int) -> int:
        """With a :attr:`window`: release ``owner``'s blocks that hold only tokens before the
        window of a query at ``position`` (no query at or after it can see them); returns how
        many were released now."""
        if self.window is None:
            return 0
        table = self._tables.get(owner, [])
        gone = [i for i in range(min(len(table), max(0, position - self.window + 1) // self.block_size)) if table[i] != NULL_BLOCK]
        self.pool.release(table[i] for i in gone)
        for i in gone:
            table[i] = NULL_BLOCK
        return len(gone)

    def copied(self) -> list[tuple[int, int]]:
        """The queued block copies, for the runner to make now; their sources are let go."""
        copies, self.pending_copies = self.pending_copies, []
        self.pool.release(src for src, _ in copies)
        return copies

    def preempted(self, owner: Hashable) -> None:
        """``owner`` gives its blocks back to be recomputed later (counted)."""
        self.free(owner)
        self.num_preemptions += 1

    # -- what metrics show ------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Blocks total / free / used, the block size, usage (used / total), preemptions,
        and the prefix cache's named blocks and evictions."""
        total, free = self.pool.num_usable, self.pool.num_free
        return {
            "kv_block_size": self.block_size,
            "kv_blocks_total": total,
            "kv_blocks_free": free,
            "kv_blocks_used": total - free,
            "kv_cache_usage_perc": (total - free) / total if total else 0.0,
            "num_preemptions": self.num_preemptions,
            "kv_blocks_cached": self.pool.num_cached,
            "prefix_evictions": self.pool.evictions,
        }
