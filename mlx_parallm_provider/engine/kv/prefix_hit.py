"""What the prefix cache holds of a prompt (:meth:`.manager.KVCacheManager.match`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class PrefixHit:
    """What the cache holds of a prompt: whole ``blocks`` to share, then (``copy_from``) a
    cached block whose first ``copy_tokens`` tokens come next, to be copied into a block
    of the request's own (it will write after them). With groups of layers, ``groups``
    holds each group's table entries for the whole blocks (a window group's first ones
    null), ``blocks`` being the first group's."""

    blocks: list[int] = field(default_factory=list)
    copy_from: Optional[int] = None
    copy_tokens: int = 0
    block_size: int = 1
    groups: Optional[list[list[int]]] = None

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.copy_tokens

    def of(self, group: int) -> list[int]:
        """Group ``group``'s table entries for the whole blocks."""
        return self.blocks if self.groups is None else self.groups[group]
