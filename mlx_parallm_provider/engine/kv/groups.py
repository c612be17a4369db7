"""Layers grouped by the tokens they attend to, so a sliding-window layer's blocks can be
released while a global layer's are kept (vLLM v1's KV cache groups, "hybrid allocator").

A model whose layers all attend alike (every token, or one window) is one group: a block
holds a run of tokens for every layer and a request has one block table. A model mixing
global and sliding-window layers (gemma3: five local layers of 512 tokens to one global;
gpt-oss: alternating 128 / global) is split into groups of ``size`` layers of one kind,
``size`` being the count of the rarest kind. Each group has its own block table per
request, drawn from the one pool, and a block holds ``size`` layers' K and V: slot ``s`` of
the storage is layer ``s`` of whichever group holds the block. A window group releases the
blocks that fall out of its window, so a long request's local layers hold a window's worth
of KV, not its length. (A kind whose count is not a multiple of ``size`` leaves the last
group's spare slots unused.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MAX_GROUPS = 8
"""More groups than this (a single global layer among many local ones) keep one group: each
group adds a block table per request and per step, and the savings shrink."""


@dataclass(frozen=True)
class LayerGroups:
    """Which group and storage slot each layer's KV lives in, and each group's window.

    Attributes:
        windows: each group's sliding window (None: every token).
        places: per layer, ``(group, slot)``.
        size: layers per group: the storage's slots.
    """

    windows: tuple[Optional[int], ...]
    places: tuple[tuple[int, int], ...]
    size: int

    @classmethod
    def single(cls, num_layers: int, window: Optional[int] = None) -> "LayerGroups":
        """Every layer in one group (one table a request), attending over ``window``."""
        return cls((window,), tuple((0, layer) for layer in range(num_layers)), num_layers)

    @classmethod
    def of(cls, layer_windows: Sequence[Optional[int]]) -> "LayerGroups":
        """Groups for layers with these windows: one when all are alike (or when grouping
        would make more than :data:`MAX_GROUPS`), else groups of the rarest kind's count."""
        kinds: dict[Optional[int], list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values()) if kinds else 0
        count = sum(-(-len(layers) // size) for layers in kinds.values()) if size else 0
        if len(kinds) <= 1 or count > MAX_GROUPS:
            # Alike, or too many groups: one table, released early only if every layer has a window.
            window = None if None in kinds or not kinds else max(kinds)  # type: ignore[type-var]
            return cls.single(len(layer_windows), window)
        windows: list[Optional[int]] = []
        places: dict[int, tuple[int, int]] = {}
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    places[layer] = (len(windows), slot)
                windows.append(window)
        return cls(tuple(windows), tuple(places[layer] for layer in range(len(layer_windows))), size)

    @property
    def count(self) -> int:
        """How many groups (block tables a request has)."""
        return len(self.windows)
