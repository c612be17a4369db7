"""Per-request block tables over a :class:`~.block_pool.BlockPool`: the one owner of who holds which
KV memory, and the prefix cache on blocks. Pure bookkeeping (nano-vllm's ``BlockManager``, vLLM
v1's ``KVCacheManager`` in miniature); the arrays live in :mod:`.storage`.

The scheduler asks :meth:`KVCacheManager.can_hold` before admitting a request and before a step
grows its rows, and preempts (frees a request's blocks with :meth:`preempted`) when the pool runs
out; the runner reads :meth:`table` to know where each row's tokens are.

Prefix caching: a block is named by its tokens and the name of the prefix before it (so equal names
mean equal prefixes, as vLLM hashes blocks), a LoRA adapter's chain rooted in its own namespace.
:meth:`register` names the blocks a request has computed (its last, partly filled one too);
:meth:`match` finds the longest run of whole named blocks a new prompt starts with, then the named
block after them that shares most of its next tokens; :meth:`grow` with that hit maps the whole
blocks into the request's table (shared, no copy) and gives it a copy of the last one (copy on
write: the request writes after the shared tokens), queued in :attr:`pending_copies` for the
runner.

Groups of layers (:mod:`.groups`): a model mixing global and sliding-window layers has one table
per group for each request, all drawn from the one pool; every method here covers all of a
request's tables. Sliding windows: a group whose layers attend to at most the last ``window``
tokens (gemma3's local layers, ``max_kv_size``) has its blocks that no later query can see released
by :meth:`slide`; their entries become the null block, so positions keep their place in the table.
A prefix hit maps cached blocks into every group's table: a window group needs only the blocks of
the window before the hit's end. (Partly shared last blocks, copied on write, are matched with a
single group only.) A disk tier under the store (one group only): :mod:`.disk_prefixes`.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

from ..plan import KVStep
from .block_pool import NULL_BLOCK, BlockPool
from .disk_prefixes import DiskPrefixes
from .prefix_hit import PrefixHit


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` KV entries."""
    return -(-tokens // block_size)


class KVCacheManager:
    """Block tables of the requests that hold KV, and the pool they draw on.

    Args:
        num_blocks: blocks in the pool, the null block included.
        block_size: tokens per block.
        max_cached_blocks: the most blocks the prefix cache names (None: no bound but the pool).
        window: the most recent tokens every layer of one group attends to (None: all of them).
        windows: instead of ``window``, each group's window (:class:`.groups.LayerGroups`):
            a request has a table per group.
        disk: the prefix store's disk tier (one group of layers only).
    """

    def __init__(self, num_blocks: int, block_size: int, max_cached_blocks: Optional[int] = None, window: Optional[int] = None,
                 windows: Optional[Sequence[Optional[int]]] = None, disk: Optional[DiskPrefixes] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.windows: list[Optional[int]] = list(windows) if windows is not None else [window]
        self.pool = BlockPool(num_blocks, max_cached_blocks)
        self._tables: dict[Hashable, list[list[int]]] = {}  # owner -> a table per group
        self._limits: dict[Hashable, int] = {}  # owner -> the most entries its table may come to hold
        self.num_preemptions = 0
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) blocks, sources held
        self.disk = disk  # (one group of layers: kv_for_engine gives no disk tier to others)

    # -- questions --------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most KV entries the pool can hold (all requests together; a token once for all groups)."""
        return self.pool.num_usable * self.block_size // len(self.windows)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and held by nobody)."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix store names (held or not)."""
        return self.pool.num_cached

    @property
    def max_cached_blocks(self) -> int:
        """The most blocks the prefix store may name."""
        return self.pool.max_cached or self.pool.num_usable

    def for_step(self, owners: Sequence[Hashable]) -> KVStep:
        """What the runner needs of KV memory for a step over ``owners``' rows: their tables, the
        queued block copies (sources let go now), the blocks the arrays must and may come to hold."""
        groups = range(len(self.windows))
        tables = {o: [self.table(o, g) for g in groups] for o in owners}
        high = self.pool.high_water()
        saves, loads = self.disk.take(self.pool) if self.disk is not None else ([], [])
        return KVStep(tables, self.copied(), high, high + self.blocks_to_come(), saves=saves, loads=loads)

    def arrays_hold(self, blocks: int) -> None:
        """The arrays behind the pool hold ``blocks`` blocks now (the pool hands out blocks
        within them first)."""
        self.pool.physical = blocks

    def table(self, owner: Hashable, group: int = 0) -> list[int]:
        """``owner``'s blocks of ``group``, in token order (empty if it holds none)."""
        tables = self._tables.get(owner)
        return tables[group] if tables is not None else []

    def _window_blocks(self, group: int) -> Optional[int]:
        """The most blocks a table of ``group`` holds live (None: no window): a window's worth,
        the block it straddles at its start, and the block being written."""
        window = self.windows[group]
        return None if window is None else blocks_for(window, self.block_size) + 2

    def _targets(self, tokens: int, window_end: Optional[int]) -> list[int]:
        """Each group's entries for ``tokens``: window groups only to ``window_end`` when given."""
        end = tokens if window_end is None else min(tokens, window_end)
        return [blocks_for(tokens if w is None else end, self.block_size) for w in self.windows]

    def blocks_to_grow(self, owner: Hashable, tokens: int, window_end: Optional[int] = None) -> int:
        """Blocks ``owner`` must add so that its tables hold ``tokens`` entries (its window
        groups' only ``window_end``, when given: a prompt prefilled in chunks needs a window
        group's blocks only up to the chunk being computed)."""
        return sum(max(0, need - len(self.table(owner, g))) for g, need in enumerate(self._targets(tokens, window_end)))

    def blocks_to_come(self) -> int:
        """Blocks the tables may still add before each reaches its limit (prompt +
        ``max_tokens``, given to :meth:`grow`): what the arrays may have to hold beyond the
        blocks in use for the requests holding blocks now. (A window group counts no more
        than its window's blocks.)"""
        total = 0
        for owner, limit in self._limits.items():
            need = blocks_for(limit, self.block_size)
            for g in range(len(self.windows)):
                table, most = self.table(owner, g), self._window_blocks(g)
                more = max(0, need - len(table))
                if most is not None:
                    more = min(more, max(0, most - _live(table)))
                total += more
        return total

    def can_hold(self, wanted: dict[Hashable, int], window_ends: Optional[dict[Hashable, int]] = None) -> bool:
        """Whether every ``owner -> tokens`` in ``wanted`` can be held at once (window groups
        to ``window_ends[owner]`` where given)."""
        ends = window_ends or {}
        return sum(self.blocks_to_grow(o, n, ends.get(o)) for o, n in wanted.items()) <= self.pool.num_free

    def admission_cost(self, tokens: int, prefix: Optional[PrefixHit] = None, window_end: Optional[int] = None) -> int:
        """Free blocks a new request's tables of ``tokens`` entries (window groups'
        ``window_end``, when given) starting with ``prefix`` take: their own blocks, plus the
        cached blocks they share (or hold to copy) that nobody holds now (they count as free
        until then)."""
        targets = self._targets(tokens, window_end)
        cost = sum(targets)
        if prefix is not None and prefix.tokens:
            for g in range(len(self.windows)):
                entries = prefix.of(g)
                cost -= min(len(entries), targets[g])
                cost += sum(b != NULL_BLOCK and self.pool.refs(b) == 0 for b in entries)
            cost += prefix.copy_from is not None and self.pool.refs(prefix.copy_from) == 0
        return cost

    def peak_blocks(self, prompt: int, total: int) -> int:
        """The most blocks a request of a ``prompt`` and ``total`` tokens in all holds at
        once: in each group its ``total`` tokens' blocks, or in a window group its prompt's
        (given at admission) or a window's worth and the blocks it straddles, whichever is more."""
        need = blocks_for(total, self.block_size)
        peak = 0
        for g in range(len(self.windows)):
            most = self._window_blocks(g)
            peak += need if most is None else min(need, max(blocks_for(prompt + 1, self.block_size), most))
        return peak

    def fits_request(self, prompt: int, total: int) -> bool:
        """Whether a request of a ``prompt`` and ``total`` tokens in all fits the whole pool."""
        return self.peak_blocks(prompt, total) <= self.pool.num_usable

    # -- prefix cache -----------------------------------------------------------------

    def block_keys(self, tokens: Sequence[int], blocks: int, group: int = 0, namespace: Hashable = 0) -> list[tuple[Hashable, tuple[int, ...]]]:
        """The names of the first ``blocks`` whole blocks of ``tokens`` in ``group`` (each group's blocks
        hold other layers) computed under ``namespace`` (0: the base model; else a LoRA adapter's)."""
        bs, keys = self.block_size, []
        parent = self._root(group, namespace)
        for i in range(blocks):
            keys.append((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            parent = hash(keys[-1])
        return keys

    @staticmethod
    def _root(group: int, namespace: Hashable) -> Hashable:  # (the parent of a chain's first block)
        return (0 if group == 0 else ("group", group)) if namespace == 0 else ("group", group, namespace)

    def _parent(self, keys: list[tuple[Hashable, tuple[int, ...]]], namespace: Hashable = 0) -> Hashable:
        return hash(keys[-1]) if keys else self._root(0, namespace)

    def match(self, tokens: Sequence[int], limit: int, namespace: Hashable = 0) -> PrefixHit:
        """What the cache holds of the longest prefix of ``tokens`` computed under
        ``namespace`` (see :meth:`block_keys`), at most ``limit`` tokens of it (no side effects)."""
        if len(self.windows) > 1:
            return self._match_groups(tokens, limit, namespace)
        bs, found = self.block_size, []
        keys = self.block_keys(tokens, min(limit, len(tokens)) // bs, namespace=namespace)
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
            for block, held in self.pool.children(self._parent(keys[: len(found)], namespace)):
                n = 0
                for a, b in zip(held, nxt):
                    if a != b:
                        break
                    n += 1
                if n > best_len:
                    best, best_len = block, n
        return PrefixHit(found, best, best_len, bs)

    def _match_groups(self, tokens: Sequence[int], limit: int, namespace: Hashable = 0) -> PrefixHit:
        """:meth:`match` of whole blocks in every group: the most whole blocks ``k`` such that
        each group without a window holds blocks ``0..k`` and each window group the blocks
        its window reaches back to from position ``k * block_size``."""
        bs = self.block_size
        n = min(limit, len(tokens)) // bs
        found = [[self.pool.lookup(key) for key in self.block_keys(tokens, n, g, namespace)] for g in range(len(self.windows))]
        k = n
        for g, blocks in enumerate(found):
            if self.windows[g] is None:
                k = min(k, next((i for i, b in enumerate(blocks) if b is None), n))
        while k > 0 and not all(self._reaches(found[g], g, k) for g in range(len(self.windows)) if self.windows[g] is not None):
            k -= 1
        groups = []
        for g, blocks in enumerate(found):
            first = self._first_seen(g, k)
            groups.append([NULL_BLOCK] * first + [b for b in blocks[first:k]])  # type: ignore[misc]
        return PrefixHit(groups[0], None, 0, bs, groups if len(groups) > 1 else None)

    def _first_seen(self, group: int, blocks: int) -> int:
        """The first block a query right after ``blocks`` whole blocks sees in ``group``."""
        window = self.windows[group]
        return 0 if window is None else max(0, (blocks * self.block_size - window) // self.block_size)

    def _reaches(self, found: list[Optional[int]], group: int, k: int) -> bool:
        return all(b is not None for b in found[self._first_seen(group, k) : k])

    def register(self, owner: Hashable, tokens: Sequence[int], computed: int, namespace: Hashable = 0) -> int:
        """Name ``owner``'s blocks holding its first ``computed`` tokens (``tokens[:computed]``) under
        ``namespace`` (:meth:`block_keys`; the base model's go to the disk tier too), the last partly
        filled one too (one group only), so later prompts can share them; returns how many were named."""
        bs, named = self.block_size, 0
        for g in range(len(self.windows)):
            table = self.table(owner, g)
            upto = min(computed, len(tokens), len(table) * bs)
            keys = self.block_keys(tokens, upto // bs, g, namespace)
            new = [i for i, (block, key) in enumerate(zip(table, keys)) if block != NULL_BLOCK and self.pool.set_key(block, key)]
            named += len(new)
            if self.disk is not None and new and namespace == 0:
                self.disk.named(tokens, [(i, table[i], keys[i]) for i in new], bs)
            if len(self.windows) == 1 and upto % bs and table[len(keys)] != NULL_BLOCK:
                last = (self._parent(keys, namespace), tuple(tokens[len(keys) * bs : upto]))
                named += self.pool.set_key(table[len(keys)], last)
        return named

    # -- changes ----------------------------------------------------------------------

    def grow(self, owner: Hashable, tokens: int, prefix: Optional[PrefixHit] = None, limit: Optional[int] = None,
             window_end: Optional[int] = None) -> None:
        """Make ``owner``'s tables hold ``tokens`` entries, its window groups' ``window_end``
        when given (ValueError if blocks run out), starting new tables with a cached
        ``prefix``: its whole blocks shared, its last block copied into one of the owner's
        own (queued in :attr:`pending_copies`). ``limit``: the most entries the owner will
        ever hold (see :meth:`blocks_to_come`)."""
        if limit is not None:
            self._limits[owner] = limit
        created = owner not in self._tables
        if created:
            tables = self._tables[owner] = [[] for _ in self.windows]
            if prefix is not None and prefix.tokens:
                for g, table in enumerate(tables):
                    entries = prefix.of(g)
                    held = [b for b in entries if b != NULL_BLOCK]
                    self.pool.share(held)
                    self.pool.touch(held)
                    table.extend(entries)
        tables = self._tables[owner]
        lengths = [len(t) for t in tables]
        copy = None
        try:
            if created and prefix is not None and prefix.copy_from is not None and prefix.tokens:
                tables[0].extend(self.pool.allocate(1))
                self.pool.share([prefix.copy_from])  # held until copied
                copy = (prefix.copy_from, tables[0][-1])
                self.pending_copies.append(copy)
            for table, need in zip(tables, self._targets(tokens, window_end)):
                if need > len(table):
                    table.extend(self.pool.allocate(need - len(table)))
        except ValueError:  # out of blocks in a later group: give back what this call took
            if copy is not None:
                self.pending_copies.remove(copy)
                self.pool.release([copy[0]])
            for table, n in zip(tables, lengths):
                self._cut(table, n)
            if created:
                self.free(owner)
            raise

    def hold(self, wanted: dict[Hashable, int], window_ends: Optional[dict[Hashable, int]] = None) -> bool:
        """Make each ``owner -> tokens`` of ``wanted`` hold that many entries (its window groups
        up to ``window_ends[owner]`` where given; the others exactly, see :meth:`fit`) if the
        pool can hold them all (:meth:`can_hold`); False, nothing changed, if it cannot."""
        ends = window_ends or {}
        if len(self.windows) == 1 and self.windows[0] is None:  # (rows holding just their blocks: fit() would change nothing)
            tables, bs = self._tables, self.block_size
            wanted = {o: n for o, n in wanted.items() if o in ends or o not in tables or len(tables[o][0]) != blocks_for(n, bs)}
        if not self.can_hold(wanted, ends):
            return False
        for owner, tokens in wanted.items():
            if owner in ends:
                self.grow(owner, tokens, window_end=ends[owner])
            else:
                self.fit(owner, tokens)
        return True

    def fit(self, owner: Hashable, tokens: int) -> None:
        """Make ``owner``'s tables hold exactly the blocks ``tokens`` entries need: grown, or
        their blocks past them released (rejected speculative tokens' KV, never cached)."""
        keep = blocks_for(tokens, self.block_size)
        for table in self._tables.get(owner, []):
            self._cut(table, keep)
        self.grow(owner, tokens)

    def _cut(self, table: list[int], keep: int) -> None:
        """Release ``table``'s blocks past its first ``keep`` entries (last first) and drop them."""
        if len(table) > keep:
            self.pool.release(b for b in reversed(table[keep:]) if b != NULL_BLOCK)
            del table[keep:]

    def free(self, owner: Hashable) -> int:
        """Release every block ``owner`` holds (cached ones stay cached); returns how many."""
        blocks = [b for table in self._tables.pop(owner, []) for b in table if b != NULL_BLOCK]
        self._limits.pop(owner, None)
        self.pool.release(reversed(blocks))  # the prompt's first blocks are evicted last
        return len(blocks)

    def slide(self, owner: Hashable, position: int) -> int:
        """In each window group, release ``owner``'s blocks that hold only tokens before the
        window of a query at ``position`` (no query at or after it can see them); returns
        how many were released now."""
        released = 0
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = self.table(owner, g)
            gone = range(len(table) - _live(table), min(len(table), max(0, position - window + 1) // self.block_size))
            self.pool.release(table[i] for i in gone)
            for i in gone:
                table[i] = NULL_BLOCK
            released += len(gone)
        return released

    def copied(self) -> list[tuple[int, int]]:
        """The queued block copies, for the runner to make now; their sources are let go."""
        copies, self.pending_copies = self.pending_copies, []
        self.pool.release(src for src, _ in copies)
        return copies

    def reusable(self, tokens: int, length: int) -> int:
        """Of ``tokens`` a prompt shares with one of ``length`` being prefilled, how many it can reuse once cached."""
        return tokens

    def preempted(self, owner: Hashable) -> None:
        """``owner`` gives its blocks back to be recomputed later (counted)."""
        self.free(owner)
        self.num_preemptions += 1

    def stats(self) -> dict[str, float]:
        """Blocks total / free / used, block size, usage, preemptions, the prefix cache's named blocks and evictions."""
        total, free = self.pool.num_usable, self.pool.num_free
        return {"kv_block_size": self.block_size, "kv_blocks_total": total, "kv_blocks_free": free, "kv_blocks_used": total - free,
                "kv_cache_usage_perc": (total - free) / total if total else 0.0, "num_preemptions": self.num_preemptions,
                "kv_blocks_cached": self.pool.num_cached, "prefix_evictions": self.pool.evictions}


def _live(table: list[int]) -> int:
    """How many entries at the end of ``table`` hold blocks. The null entries of a table are
    one leading run (:meth:`KVCacheManager.slide` releases from the front; a prefix hit maps a
    window group's blocks after null ones; nothing else writes the null block), so this reads
    only the live ones, a window's worth, not the whole table every step."""
    n = 0
    for block in reversed(table):
        if block == NULL_BLOCK:
            break
        n += 1
    return n
