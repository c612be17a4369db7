"""A decode step's forward pass as one compiled MLX function (``mx.compile``).

Building a step's graph is Python work on the host: a 16-layer model's decode step is ~500
ops, built through mlx-lm's modules and this package's caches (~1.7 ms on a 2-core Xeon at
64 rows). Where a GPU computes the step in less, the host's building sets the pace. Compiled,
the graph is traced once per shape and replayed after (in C++), and MLX fuses its elementwise
ops into fewer kernels.

A compiled function sees only its inputs: the rows' tokens, positions, write slots and block
tables come as arrays (:meth:`.PagedBatch.of_arrays`), and the KV arrays go in and come back
(their writes are part of the graph). Shapes are padded so traces stay few: rows to 1, 2, 4,
then multiples of 8 (the padding rows write into the null block and attend to one slot of
it), the block tables' width to a power of two. The KV arrays' growth (each growth is a new
shape) starts a new compiled function, the old traces dropped.

It applies (:func:`applies`) where every layer attends through the block tables by the
backend's kernels, writing the KV by MLX's own scatters (the GPU kernels' backend), with no
sliding windows or groups of layers, to steps whose rows use no LoRA adapter (the rows'
adapters are not an input: such a step runs uncompiled).
Before its first step, a pass of the same rows is traced and replayed over scratch KV arrays
(the null block alone): a pass that turns out not to be traceable (a layer that would gather)
or a kernel that fails on the device turns it off for the engine there, logged, the KV arrays
untouched; steps then run uncompiled, as they would have. A real step is never evaluated
while the arrays from before it are held (MLX would then copy every KV array whole to write a
few slots).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Sequence

import mlx.core as mx

from ..models import backends
from .kv.block_pool import NULL_BLOCK
from .kv.paged_cache import PagedBatch
from .kv.storage import PagedKVStorage

logger = logging.getLogger(__name__)


def padded_rows(rows: int) -> int:
    """The rows a step of ``rows`` is padded to: 1, 2, 4, then a multiple of 8."""
    return rows if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8


def padded_width(blocks: int) -> int:
    """The block tables' width a step whose longest table holds ``blocks`` is padded to: a power of two."""
    return 1 << max(0, blocks - 1).bit_length()


def applies(model: Any, storage: PagedKVStorage, windows: Sequence[Optional[int]], grouped: bool, gathered: bool) -> Optional[str]:
    """Why ``model``'s decode steps cannot run compiled over ``storage``, or None where they can
    (see the module docstring; :attr:`~...config.DeviceConfig.compile_decode`)."""
    backend = backends.of(model)
    setting = getattr(getattr(backend, "device", None), "compile_decode", None)
    if setting is False:
        return "compile_decode is off"
    if backend is None or gathered or grouped or any(w is not None for w in windows):
        return "the model's layers do not all attend through the block tables"
    if setting is None:
        kernels_ready = getattr(backend, "kernels_ready", None)
        if not backend.reads_pages or backend.step_writes_in_place or kernels_ready is None:
            return "the backend has no GPU paged kernels"
        if not kernels_ready(bool(storage.bits)):  # (checked now: nothing may evaluate while tracing)
            return "the paged kernels are not in use"
    return None


class CompiledDecode:
    """The compiled decode forward of one engine's model over its KV storage.

    Args:
        model: the engine's model (its backend installed).
        storage: the KV arrays it reads and writes.
        pad_id: the token the padding rows carry.
    """

    def __init__(self, model: Any, storage: PagedKVStorage, pad_id: int) -> None:
        self.model, self.storage, self.pad_id = model, storage, pad_id
        self.off: Optional[str] = None  # why it was turned off
        self.calls = 0
        self._fn: Any = None
        self._blocks = -1  # the KV arrays' blocks the compiled function was made for
        self._checked = False  # whether a pass was traced and replayed on scratch arrays

    def __call__(self, tokens: mx.array, starts: Sequence[int], tables: Sequence[Sequence[int]]) -> Optional[mx.array]:
        """The logits ``(B, 1, vocab)`` of one decode step of ``tokens`` ``(B, 1)`` at
        positions ``starts`` over block ``tables``, its K/V written; None where it cannot run
        compiled (then nothing was written)."""
        storage = self.storage
        if self.off is not None or storage.keys[0] is None:
            return None
        B = len(starts)
        rows, width = padded_rows(B), padded_width(max(len(t) for t in tables))
        pad = rows - B
        if not self._checked and not self._check(rows, width):
            return None
        # The pass's arrays as an uncompiled pass builds them, over the padded rows (a padding
        # row: a table of null blocks, position 0, so it writes and reads the null block's slot 0).
        padded = [list(t) + [NULL_BLOCK] * (width - len(t)) for t in tables] + [[NULL_BLOCK] * width] * pad
        eager = PagedBatch(storage, padded, list(starts) + [0] * pad, [1] * rows, 1)
        group = eager.passes[0]
        tokens = tokens.astype(mx.int32)
        if pad:
            tokens = mx.concatenate([tokens, mx.full((pad, 1), self.pad_id, dtype=mx.int32)])
        if storage.physical_blocks != self._blocks:  # (a new shape of every KV array: the old traces are done with)
            self._fn, self._blocks = mx.compile(functools.partial(self._forward, storage)), storage.physical_blocks
        before = storage.arrays()
        try:  # (traced or replayed: nothing is evaluated, so holding the arrays from before copies nothing)
            out, *written = self._fn(tokens, eager.offset, eager.lengths, group.write_slots, group.table, *before)
        except Exception as exc:
            storage.set_arrays(before)
            self._turn_off(exc)
            return None
        storage.set_arrays(written)
        self.calls += 1
        return out[:B] if pad else out

    def _check(self, rows: int, width: int) -> bool:
        """Trace a pass of ``rows`` rows and tables ``width`` blocks wide over scratch arrays
        (of the null block alone) and evaluate its replay, where a pass that cannot be traced
        or a kernel failing on the device shows without touching the KV arrays; whether it ran.
        (The real pools are never evaluated holding their arrays from before: MLX would copy
        every one of them whole to write a few slots.)"""
        scratch = self.storage.scratch(NULL_BLOCK + 1)
        eager = PagedBatch(scratch, [[NULL_BLOCK] * width] * rows, [0] * rows, [1] * rows, 1)
        group = eager.passes[0]
        try:
            tried = mx.compile(functools.partial(self._forward, scratch))
            out, *written = tried(mx.full((rows, 1), self.pad_id, dtype=mx.int32), eager.offset, eager.lengths, group.write_slots,
                                  group.table, *scratch.arrays())
            mx.eval(out, *written)
        except Exception as exc:
            self._turn_off(exc)
            return False
        self._checked = True
        return True

    def _turn_off(self, exc: Exception) -> None:
        self.off = f"{type(exc).__name__}: {exc}"
        logger.warning("decode steps run uncompiled: %s", self.off)

    def _forward(self, storage: PagedKVStorage, tokens: mx.array, offset: mx.array, lengths: mx.array, slots: mx.array,
                 table: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        """(Traced) the model over a pass of ``storage`` built from the arrays; the logits and
        the KV arrays after its writes. (It leaves ``storage`` holding the trace's arrays: the
        caller puts the replay's outputs there, or, where it failed, the arrays from before.)"""
        storage.set_arrays(list(arrays))
        batch = PagedBatch.of_arrays(storage, offset, lengths, slots, table)
        logits = self.model(tokens, cache=batch.layers())
        return (logits, *storage.arrays())
