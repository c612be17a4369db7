"""Consistent hashing with bounded loads: which replica owns a prefix, and whether it has room.

Pure bookkeeping, no LiteLLM and no I/O. Each replica id is placed on a ring of 64-bit
hashes at ``vnodes`` points; a prefix key belongs to the first replica clockwise of its own
hash, so adding or removing a replica moves only the keys next to its points (the other
replicas keep the prefixes whose KV they already hold). A replica is *full* when it holds
``capacity`` requests or more than ``(1 + balance) x`` the mean load (Mirrokni, Thorup and
Zadimoghaddam's bounded loads, as SGLang's router and vLLM's production stack use it); then
the request goes to the least busy replica with room instead.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional


def hash64(text: str) -> int:
    """A stable 64-bit hash of ``text`` (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Choice:
    """Where a request goes and why.

    Attributes:
        replica: the chosen replica id.
        owner: the replica that owns the request's prefix on the ring.
        reason: ``"owner"`` (it had room), ``"full"`` (the owner was full: least busy
            replica) or ``"no-prefix"`` (no prefix key: least busy replica).
    """

    replica: str
    owner: Optional[str]
    reason: str


class HashRing:
    """Replica ids placed on a hash ring.

    Args:
        replicas: replica ids (any strings; LiteLLM deployment ids in practice).
        vnodes: points per replica; more points spread keys more evenly.
    """

    def __init__(self, replicas: Iterable[str], vnodes: int = 64) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.replicas = tuple(sorted(set(replicas)))
        points = sorted((hash64(f"{replica}#{i}"), replica) for replica in self.replicas for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]

    def owners(self, key: str) -> list[str]:
        """Every replica in ring order starting from ``key``'s owner (each once)."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, hash64(key)) % len(self._hashes)
        seen: dict[str, None] = {}
        for i in range(len(self._owners)):
            seen.setdefault(self._owners[(start + i) % len(self._owners)])
            if len(seen) == len(self.replicas):
                break
        return list(seen)

    def owner(self, key: str, among: Optional[Iterable[str]] = None) -> Optional[str]:
        """The first replica clockwise of ``key`` (restricted to ``among`` if given)."""
        allowed = None if among is None else set(among)
        for replica in self.owners(key):
            if allowed is None or replica in allowed:
                return replica
        return None


def is_full(load: int, capacity: Optional[int], total: int, n: int, balance: Optional[float]) -> bool:
    """Whether a replica holding ``load`` requests takes no more: at ``capacity``, or above
    ``ceil((1 + balance) * (total + 1) / n)`` where ``total`` is the load of all ``n``
    replicas (None disables either bound)."""
    if capacity is not None and load >= capacity:
        return True
    if balance is not None and n > 0:
        return load + 1 > math.ceil((1.0 + balance) * (total + 1) / n)
    return False


def choose(
    ring: HashRing,
    key: Optional[str],
    loads: Mapping[str, int],
    capacities: Optional[Mapping[str, Optional[int]]] = None,
    balance: Optional[float] = None,
) -> Choice:
    """The replica for a request with prefix ``key`` among the replicas in ``loads``
    (replica id -> requests it holds now): the key's owner while it is not full, else the
    least busy replica that is not full (the least busy of all when every one is), ties
    broken in ring order so the choice is deterministic."""
    if not loads:
        raise ValueError("no replica to choose from")
    caps = capacities or {}
    order = ring.owners(key) if key is not None else list(ring.replicas)
    candidates = [r for r in order if r in loads] + sorted(r for r in loads if r not in set(order))
    owner = candidates[0] if key is not None else None
    total = sum(loads.values())
    if owner is not None and not is_full(loads[owner], caps.get(owner), total, len(loads), balance):
        return Choice(owner, owner, "owner")
    rank = {r: i for i, r in enumerate(candidates)}
    roomy = [r for r in candidates if not is_full(loads[r], caps.get(r), total, len(loads), balance)]
    least = min(roomy or candidates, key=lambda r: (loads[r], rank[r]))
    return Choice(least, owner, "full" if owner is not None else "no-prefix")
