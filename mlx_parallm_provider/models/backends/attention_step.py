"""A step's attention block as one op (a decode or verify step, or a prefill piece): the
routed ``__call__`` of mlx-lm attention classes whose code is known to be plain "project,
RoPE, write the cache, attend, project".

On the CPU a one-token step of the default model spent ~6.5 of its ~20 ms between the q/k/v
projections and the output projection: ~25 small ops a layer (reshapes, transposes, two RoPEs,
two scatters into the KV pools, copies, the attention) at ~3-9 us of dispatch each. Where
the model's backend and the layer's cache both take it (:meth:`.MLXOps.steps_attention`, the
cache's ``can_attend_step``), the routed attention hands the projections to the cache's
``attend_step`` (one kernel: RoPE, the K/V writes, paged attention) and the result to
``o_proj``; everywhere else (other RoPE kinds, sliding windows, MLX's ops) it runs mlx-lm's
code as routed. Both compute the same numbers, bit for bit.

On a GPU (:class:`.GPUKernels`) the same seam takes the step with fewer MLX ops instead of
one: reshapes where mlx-lm transposes, RoPE, the K/V scattered into the pools, the paged
attention kernels (each op is the host's work to build and mostly a launch).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Optional

_PLAIN_ATTENTION = (("mlx_lm.models.llama", "Attention"), ("mlx_lm.models.qwen2", "Attention"))
"""mlx-lm attention classes whose ``__call__`` is exactly q/k/v projections, RoPE at
``cache.offset``, ``cache.update_and_fetch``, ``scaled_dot_product_attention(scale=self.scale)``
and ``o_proj`` (no q/k norms, no softcap, no sinks), with ``n_heads`` and ``rope`` attributes."""

_codes: dict[tuple[tuple[str, str], ...], set[Any]] = {}


def plain_code(cls: type, names: tuple[tuple[str, str], ...], method: str = "__call__") -> bool:
    """Whether ``cls``'s ``method`` runs the code of one of the mlx-lm classes ``names``
    (``(module, class)`` pairs; a routed subclass's rebound method keeps its code)."""
    if names not in _codes:
        found = set()
        for module, name in names:
            try:
                found.add(getattr(getattr(importlib.import_module(module), name), method).__code__)
            except (ImportError, AttributeError):
                continue
        _codes[names] = found
    return getattr(getattr(cls, method, None), "__code__", None) in _codes[names]


def fusable(cls: type) -> bool:
    """Whether ``cls``'s ``__call__`` is one of :data:`_PLAIN_ATTENTION`'s."""
    return plain_code(cls, _PLAIN_ATTENTION)


def stepping(original: Callable[..., Any], backend: Any) -> Callable[..., Any]:
    """``original`` (an attention ``__call__``, as routed) with the fused step in front."""

    def __call__(self: Any, x: Any, mask: Optional[Any] = None, cache: Optional[Any] = None) -> Any:
        can = getattr(cache, "can_attend_step", None)
        if can is not None and backend.steps_attention(self.rope) and can(self.n_heads, x.shape[1], backend):
            out = cache.attend_step(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.n_heads, self.rope, self.scale, backend)
            return self.o_proj(out)
        return original(self, x, mask, cache)

    return functools.wraps(original)(__call__)  # (__wrapped__: what runs where the step does not apply)
