"""Linear layers that add each row's own adapter's low-rank update (Punica's gathered
LoRA, as vllm-metal's ``punica_wrapper``): one batch may mix rows of several adapters and
rows of none.

A :class:`MultiLoRALinear` keeps its base layer (``linear``, as mlx-lm's ``LoRALinear``) and
the stacked pairs of every resident adapter: ``lora_a`` ``(slots, input_dims, rank)`` and
``lora_b`` ``(slots, rank, output_dims)``, slot 0 all zeros (no adapter), a smaller rank padded
with zeros. A pass sets each row's slot and scale (:func:`rows_using`, on the thread running
it); the layer then computes ``linear(x) + scale[row] * ((x @ lora_a[slot]) @ lora_b[slot])``
as mlx-lm does for one adapter: on the CPU in one op of the package's extension
(``kernels/lora_update.cpp``), elsewhere with two ``gather_mm`` ops (no gathered copy of the pairs).
Outside a pass that sets rows (every row on the base model), it is its base layer alone, and
a decoder layer whose linear layers are all wrapped still takes the fused one-op step
(:func:`blocks_step_fused`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

_local = threading.local()


@dataclass(frozen=True)
class RowAdapters:
    """The adapter of each row of one pass: its slot (``(B,)``) and scale (``(B,)``, and
    ``(B, 1, 1)`` to scale a row's update)."""

    slots: mx.array
    scales: mx.array
    row_scales: mx.array


def current_rows() -> Optional[RowAdapters]:
    """The rows' adapters of the pass running on this thread, or None (the base model)."""
    return getattr(_local, "rows", None)


@contextlib.contextmanager
def rows_using(slots: Sequence[int], scales: Sequence[float]) -> Iterator[None]:
    """Within the block, this thread's passes apply adapter ``slots[b]`` (scale ``scales[b]``)
    to row ``b``; all slots 0 (no adapter anywhere) sets nothing."""
    if not any(slots):
        yield
        return
    previous = current_rows()
    flat = mx.array(list(scales), dtype=mx.float32)
    _local.rows = RowAdapters(mx.array(list(slots), dtype=mx.uint32), flat, flat[:, None, None])
    try:
        yield
    finally:
        _local.rows = previous


class MultiLoRALinear(nn.Module):
    """A linear layer plus each row's adapter's update (see the module's docstring)."""

    def __init__(self, linear: nn.Module, input_dims: int, output_dims: int) -> None:
        super().__init__()
        self.linear = linear
        self.input_dims, self.output_dims = input_dims, output_dims
        self._lora_a = mx.zeros((1, input_dims, 1))
        self._lora_b = mx.zeros((1, 1, output_dims))
        self._lora_a_t: Optional[mx.array] = None  # (slots, rank, input_dims), for the CPU's one-op update

    @property
    def slots(self) -> int:
        return self._lora_a.shape[0]

    @property
    def rank(self) -> int:
        return self._lora_a.shape[2]

    def set_slot(self, slot: int, pair: Optional[tuple[mx.array, mx.array]], slots: int, rank: int) -> None:
        """Put ``pair`` (``(lora_a, lora_b)``; None: zeros) into ``slot``, the stacks first
        grown to ``slots`` slots and ``rank`` (never shrunk)."""
        a, b = self._lora_a, self._lora_b
        grow_slots, grow_rank = max(0, slots - a.shape[0]), max(0, rank - a.shape[2])
        if grow_slots or grow_rank:
            a = mx.pad(a, [(0, grow_slots), (0, 0), (0, grow_rank)])
            b = mx.pad(b, [(0, grow_slots), (0, grow_rank), (0, 0)])
        r = a.shape[2]
        new_a = mx.zeros((self.input_dims, r)) if pair is None else mx.pad(pair[0].astype(mx.float32), [(0, 0), (0, r - pair[0].shape[1])])
        new_b = mx.zeros((r, self.output_dims)) if pair is None else mx.pad(pair[1].astype(mx.float32), [(0, r - pair[1].shape[0]), (0, 0)])
        a = mx.concatenate([a[:slot], new_a[None], a[slot + 1 :]])
        b = mx.concatenate([b[:slot], new_b[None], b[slot + 1 :]])
        a_t = mx.contiguous(a.swapaxes(1, 2)) if _update_op() is not None else None
        mx.eval(a, b, *([a_t] if a_t is not None else []))
        # (A pass running now keeps the arrays it took: a new slot's rows only come after.)
        self._lora_a, self._lora_b, self._lora_a_t = a, b, a_t

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        rows = current_rows()
        if rows is None:
            return y
        a, b = self._lora_a, self._lora_b
        op = _update_op()
        if op is not None and self._lora_a_t is not None and x.ndim == 3 and x.dtype == y.dtype == mx.float32:
            threads = getattr(getattr(self.linear, "backend", None), "qmatmul_threads", 1) or 1
            return op(y, x, self._lora_a_t, b, rows.slots, rows.scales, threads)
        z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=rows.slots), b, rhs_indices=rows.slots)
        z = rows.row_scales * z
        return y + (z if z.dtype == x.dtype else z.astype(x.dtype))


_op: list[Optional[Callable[..., mx.array]]] = []


def _update_op() -> Optional[Callable[..., mx.array]]:
    """The CPU extension's one-op update (``kernels/lora_update.cpp``) where MLX runs on the CPU
    and the extension builds; else None (two ``gather_mm`` and the scale: a GPU's, or no compiler)."""
    if not _op:
        from ..device import is_cpu
        from ..qmatmul_ext import load

        ext = load() if is_cpu() else None
        _op.append(getattr(ext, "lora_update", None))
    return _op[0]


def blocks_step_fused(block: Any) -> bool:
    """Whether ``block`` may take the fused one-op layer step now: none of its layers is
    adapted (:meth:`.ModelAdapters._wrap` marks it), or no row of this thread's pass has an adapter."""
    return not getattr(block, "_parallm_lora", False) or current_rows() is None


def base_linear(layer: Any) -> Any:
    """The layer a :class:`MultiLoRALinear` wraps, or ``layer`` itself."""
    return layer.linear if isinstance(layer, MultiLoRALinear) else layer
