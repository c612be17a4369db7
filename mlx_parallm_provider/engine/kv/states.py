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

Prefix caching: a state sums up all tokens before it, so a cached prefix is of use only where
the state at its end was kept. Prompts are prefilled in passes ending at *checkpoints*
(every :data:`CHECKPOINT_TOKENS` tokens, and the last block boundary before the prompt's
last token), where the row's state is copied into :class:`StateCheckpoints`, named as the
prefix cache names the block ending there. A prompt's prefix hit
(:meth:`StateSlots.match`) is cut back to the longest run of whole cached blocks whose end
has a checkpoint, which is copied into the request's slot before its first pass.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..plan import KVStep
from .manager import KVCacheManager
from .prefix_hit import PrefixHit

GROWTH = 8
"""The arrays grow by at least this many slots at a time (growing copies them)."""

CHECKPOINT_TOKENS = 512
"""A prompt's state is kept every this many tokens (rounded down to whole blocks), besides at
its last block boundary: a long shared prefix (an agent's system prompt and tools) is reused
up to the last multiple before the prompts differ. Each pass ending there costs a little
prefill speed; each checkpoint a state's bytes (from ~80 KB for LFM2-350M to ~20 MB for a
Qwen3.5-0.8B)."""

Names = Callable[[Sequence[int], int, Hashable], Hashable]
"""``names(tokens, blocks, namespace)``: the prefix cache's name of the ``blocks``-th whole
block of ``tokens`` under ``namespace`` (:meth:`.manager.KVCacheManager.block_keys`' last)."""


def checkpoint_ends(length: int, block_size: int) -> list[int]:
    """Where a prompt of ``length`` tokens has its state kept: every :data:`CHECKPOINT_TOKENS`
    (whole blocks) and at the last block boundary before its last token."""
    every = max(block_size, CHECKPOINT_TOKENS // block_size * block_size)
    last = (length - 1) // block_size * block_size
    return sorted({*range(every, last + 1, every), last} - {0}) if length > 1 else []


class StateCheckpoints:
    """Recurrent states at block boundaries, by the name of the block ending there, the least
    recently used dropped beyond ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[Hashable, dict[tuple[int, int], mx.array]] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, name: Hashable) -> bool:
        return name in self._held

    def __len__(self) -> int:
        return len(self._held)

    def put(self, name: Hashable, arrays: dict[tuple[int, int], mx.array]) -> None:
        """Keep ``arrays`` (each ``(layer, entry)``'s row) as the state at the end of ``name``."""
        if name in self._held:
            self._held.move_to_end(name)
            return
        self._held[name] = arrays
        self.nbytes += sum(a.nbytes for a in arrays.values())
        while self.nbytes > self.max_bytes and self._held:
            _, dropped = self._held.popitem(last=False)
            self.nbytes -= sum(a.nbytes for a in dropped.values())
            self.evictions += 1

    def get(self, name: Hashable) -> dict[tuple[int, int], mx.array]:
        """The state kept at the end of ``name`` (KeyError if none), now the most recently used."""
        self._held.move_to_end(name)
        return self._held[name]


class RecurrentStates:
    """The recurrent layers' states: per layer, each of its arrays as one array whose first
    axis is the slot. Made empty; an array is created at the first pass that writes it (its
    shape and dtype the model's own) and grows as higher slots are used.

    Args:
        layers: each recurrent layer (its index among the model's layers) and how many
            arrays its state is (:func:`.support.recurrent_layers`).
        padded: the layers keep each row's state at its own length in a right-padded pass
            (:func:`.support.pads_states`); else a pass must bring every row's tokens at full width.
        checkpoints: where prompts' states are kept for the prefix cache (None: not kept).
        names: the prefix cache's names of blocks, to name the kept states by.
        block_size: tokens per KV block (checkpoints fall on block boundaries).
    """

    def __init__(self, layers: dict[int, int], padded: bool = True, checkpoints: Optional[StateCheckpoints] = None,
                 names: Optional[Names] = None, block_size: int = 16) -> None:
        self.layers, self.padded = dict(layers), padded
        self.checkpoints, self.names, self.block_size = checkpoints, names, block_size
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

    def checkpoint_ends(self, length: int) -> list[int]:
        """The positions where a prompt of ``length`` tokens has its state kept (passes prefilling
        it end there); none without prefix caching."""
        return checkpoint_ends(length, self.block_size) if self.checkpoints is not None else []

    def save(self, slot: int, tokens: Sequence[int], position: int, namespace: Hashable) -> None:
        """Keep ``slot``'s state, that of ``tokens[:position]`` (a checkpoint), under the name
        of the block ending at ``position``."""
        if self.checkpoints is None or self.names is None:
            return
        index = mx.array([slot], dtype=mx.int32)
        rows = {(layer, e): a[index] for layer, entries in self._arrays.items() for e, a in enumerate(entries) if a is not None}
        mx.eval(list(rows.values()))  # copies now: the slot's arrays are written again next pass
        self.checkpoints.put(self.names(tokens, position // self.block_size, namespace), rows)

    def load(self, slot: int, name: Hashable) -> None:
        """Put the state kept under ``name`` (a checkpoint) in ``slot``."""
        assert self.checkpoints is not None
        self._grow(slot + 1)
        index = mx.array([slot], dtype=mx.int32)
        for (layer, e), rows in self.checkpoints.get(name).items():
            self._write(layer, e, index, rows)

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


@dataclass(frozen=True)
class StateHit(PrefixHit):
    """A prefix hit of whole blocks whose end has a checkpoint, ``state``: its name."""

    state: Hashable = None


class StateSlots(KVCacheManager):
    """A :class:`.manager.KVCacheManager` that also gives each request holding KV a state slot
    (:class:`RecurrentStates`' rows): taken when its tables are made, given back with its
    blocks (finished, cancelled or preempted), and named in each step's
    :attr:`~..plan.KVStep.state_slots`. With ``checkpoints`` (prefix caching), a prefix hit
    reaches only as far as a kept state (:meth:`match`), loaded into the request's slot
    before its first pass (:attr:`~..plan.KVStep.state_loads`)."""

    def __init__(self, *args: Any, checkpoints: Optional[StateCheckpoints] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoints = checkpoints  # (only read here: which prefixes have a state kept)
        self._slots: dict[Hashable, int] = {}
        self._free_slots: list[int] = []
        self._loads: dict[Hashable, Hashable] = {}  # owner -> the checkpoint its slot starts from

    def match(self, tokens: Sequence[int], limit: int, namespace: Hashable = 0) -> PrefixHit:
        """:meth:`.manager.KVCacheManager.match`'s whole blocks, cut back to the most whose end
        has a checkpoint (none with groups of layers, or without checkpoints)."""
        if self.checkpoints is None or len(self.windows) > 1:
            return PrefixHit(block_size=self.block_size)
        hit = super().match(tokens, limit, namespace)
        keys = self.block_keys(tokens, len(hit.blocks), namespace=namespace)
        for k in range(len(keys), 0, -1):
            if keys[k - 1] in self.checkpoints:
                return StateHit(hit.blocks[:k], None, 0, self.block_size, state=keys[k - 1])
        return PrefixHit(block_size=self.block_size)

    def reusable(self, tokens: int, length: int) -> int:
        """Of ``tokens`` a prompt shares with one of ``length`` being prefilled, those up to the
        last state that prefill keeps among them."""
        return max((c for c in checkpoint_ends(length, self.block_size) if c <= tokens), default=0) if self.checkpoints is not None else 0

    def grow(self, owner: Hashable, tokens: int, prefix: Optional[PrefixHit] = None, *args: Any, **kwargs: Any) -> None:
        new = owner not in self._slots
        super().grow(owner, tokens, prefix, *args, **kwargs)
        if new:
            self._slots[owner] = self._free_slots.pop() if self._free_slots else len(self._slots) + len(self._free_slots)
            if isinstance(prefix, StateHit) and prefix.tokens:
                self._loads[owner] = prefix.state

    def free(self, owner: Hashable) -> int:
        slot = self._slots.pop(owner, None)
        self._loads.pop(owner, None)
        if slot is not None:
            self._free_slots.append(slot)
        return super().free(owner)

    def for_step(self, owners: Sequence[Hashable]) -> KVStep:
        step = super().for_step(owners)
        step.state_slots = {o: self._slots[o] for o in owners if o in self._slots}
        step.state_loads = {o: self._loads.pop(o) for o in owners if o in self._loads}
        return step
