"""The recurrent state of a hybrid model's state-space and linear-attention layers, a slot per
request (vLLM v1's Mamba state beside the paged KV, in miniature).

Such a layer (LFM2's short convolutions, Qwen3.5's gated DeltaNet, Granite 4.0-H's and
Nemotron-H's Mamba 2) keeps, for each sequence, a few arrays summing up every token so far,
and mlx-lm passes them to it in an ``ArraysCache``. Here each of those arrays is one array
for all requests, a row per *slot*: :class:`StateSlots` gives each request holding KV a
slot (the KV manager's bookkeeping, freed with its blocks), and :class:`RecurrentStates`
holds the rows. A forward pass (:meth:`RecurrentStates.open`) gathers its rows' states into
one ``ArraysCache`` per layer, their new tokens' counts as its ``lengths`` (mlx-lm's
right-padded batches: a padding position leaves a row's state as it was), and
:meth:`StatePass.commit` writes the states the model left back into the rows' slots. A row
whose pass starts at position 0 (a new prompt, or one preempted and recomputed) starts
from zeros whatever its slot held.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..plan import KVStep
from .manager import KVCacheManager

GROWTH = 8
"""The arrays grow by at least this many slots at a time (growing copies them)."""


class RecurrentStates:
    """The recurrent layers' states: per layer, each of its arrays as one array whose first
    axis is the slot. Made empty; an array is created at the first pass that writes it (its
    shape and dtype the model's own) and grows as higher slots are used.

    Args:
        layers: each recurrent layer (its index among the model's layers) and how many
            arrays its state is (:func:`.support.recurrent_layers`).
        padded: the layers keep each row's state at its own length in a right-padded pass
            (:func:`.support.pads_states`); else a pass must bring every row's tokens at full width.
    """

    def __init__(self, layers: dict[int, int], padded: bool = True) -> None:
        self.layers, self.padded = dict(layers), padded
        self._arrays: dict[int, list[Optional[mx.array]]] = {layer: [None] * n for layer, n in self.layers.items()}
        self.num_slots = 0

    def arrays(self) -> list[mx.array]:
        """Every array held (what a step's evaluation waits for)."""
        return [a for entries in self._arrays.values() for a in entries if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes the states hold."""
        return sum(a.nbytes for a in self.arrays())

    def open(self, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], width: int) -> "StatePass":
        """One forward pass's states: rows in ``slots``, bringing ``lengths[b]`` new tokens
        from position ``starts[b]`` (at most ``width``; the rest padding, only where :attr:`padded`)."""
        if not self.padded and any(n != width for n in lengths):
            raise ValueError("this model's recurrent layers take no padded rows: prefill them a row at a time")
        self._grow(max(slots, default=-1) + 1)
        return StatePass(self, list(slots), [s == 0 for s in starts], list(lengths), width)

    def _grow(self, slots: int) -> None:
        if slots <= self.num_slots:
            return
        slots = max(slots, self.num_slots + GROWTH)
        for entries in self._arrays.values():
            for e, a in enumerate(entries):
                if a is not None:
                    entries[e] = mx.concatenate([a, mx.zeros((slots - a.shape[0], *a.shape[1:]), a.dtype)])
        self.num_slots = slots

    def _read(self, layer: int, entry: int, index: mx.array, fresh: Optional[mx.array]) -> Optional[mx.array]:
        a = self._arrays[layer][entry]
        if a is None:
            return None
        rows = a[index]
        return rows if fresh is None else mx.where(fresh.reshape(-1, *(1,) * (rows.ndim - 1)), mx.zeros_like(rows), rows)

    def _write(self, layer: int, entry: int, index: mx.array, rows: mx.array) -> None:
        entries = self._arrays[layer]
        if entries[entry] is None:
            entries[entry] = mx.zeros((self.num_slots, *rows.shape[1:]), rows.dtype)
        entries[entry][index] = rows.astype(entries[entry].dtype)


class StatePass:
    """A forward pass's view of the states: an ``ArraysCache`` per recurrent layer holding its
    rows' states (None entries where every row starts from zeros: the layer makes them), to
    give the model beside the attention layers' caches (:meth:`interleave`), then
    :meth:`commit`."""

    def __init__(self, states: RecurrentStates, slots: list[int], fresh: list[bool], lengths: list[int], width: int) -> None:
        self.states, self.index = states, mx.array(slots, dtype=mx.int32)
        every_fresh = all(fresh)
        mask = mx.array(fresh) if any(fresh) and not every_fresh else None
        self.caches: dict[int, ArraysCache] = {}
        for layer, n in states.layers.items():
            cache = ArraysCache(n)
            if not every_fresh:
                for e in range(n):
                    cache[e] = states._read(layer, e, self.index, mask)
            if any(length != width for length in lengths):
                cache.lengths = mx.array(lengths, dtype=mx.int32)
            self.caches[layer] = cache

    def interleave(self, attention: Sequence[Any]) -> list[Any]:
        """The model's cache list: the recurrent layers' caches in their places, the
        attention layers' (``attention``, in layer order) in the others."""
        rest = iter(attention)
        return [self.caches[layer] if layer in self.caches else next(rest) for layer in range(len(attention) + len(self.caches))]

    def commit(self) -> None:
        """Write the states the model left in the caches back into the rows' slots."""
        for layer, cache in self.caches.items():
            for e, rows in enumerate(cache.cache):
                if rows is not None:
                    self.states._write(layer, e, self.index, rows)


class StateSlots(KVCacheManager):
    """A :class:`.manager.KVCacheManager` that also gives each request holding KV a state slot
    (:class:`RecurrentStates`' rows): taken when its tables are made, given back with its
    blocks (finished, cancelled or preempted), and named in each step's
    :attr:`~..plan.KVStep.state_slots`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots: dict[Hashable, int] = {}
        self._free_slots: list[int] = []

    def grow(self, owner: Hashable, tokens: int, *args: Any, **kwargs: Any) -> None:
        super().grow(owner, tokens, *args, **kwargs)
        if owner not in self._slots:
            self._slots[owner] = self._free_slots.pop() if self._free_slots else len(self._slots) + len(self._free_slots)

    def free(self, owner: Hashable) -> int:
        slot = self._slots.pop(owner, None)
        if slot is not None:
            self._free_slots.append(slot)
        return super().free(owner)

    def for_step(self, owners: Sequence[Hashable]) -> KVStep:
        step = super().for_step(owners)
        step.state_slots = {o: self._slots[o] for o in owners if o in self._slots}
        return step
