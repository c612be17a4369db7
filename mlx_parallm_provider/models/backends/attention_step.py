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
from typing import Any, Callable, Optional, Sequence

_PLAIN_ATTENTION = (("mlx_lm.models.llama", "Attention"), ("mlx_lm.models.qwen2", "Attention"))
"""mlx-lm attention classes whose ``__call__`` is exactly q/k/v projections, RoPE at
``cache.offset``, ``cache.update_and_fetch``, ``scaled_dot_product_attention(scale=self.scale)``
and ``o_proj`` (no q/k norms, no softcap, no sinks), with ``n_heads`` and ``rope`` attributes."""

_codes: dict[tuple[tuple[str, str], ...], set[Any]] = {}
ORIGINAL = "_parallm_original_class"
"""On a class :func:`.routing.route` derived: the mlx-lm class it derives from."""


def original_class(layer: Any) -> type:
    """The class :func:`.routing.route` derived ``layer``'s from (its own where route did not touch it)."""
    return getattr(type(layer), ORIGINAL, type(layer))


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


Projections = Callable[[Any, Any], Sequence[Any]]
"""``project(attention, x)``: the attention's queries, keys and values of ``x``."""


def own_projections(attention: Any, x: Any) -> tuple[Any, Any, Any]:
    """``attention``'s q/k/v projections of ``x``, each layer called (mlx-lm's code)."""
    return attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)


def stepping(original: Callable[..., Any], backend: Any, project: Optional[Projections] = None) -> Callable[..., Any]:
    """``original`` (an attention ``__call__``, as routed) with the fused step in front;
    ``project``: the queries, keys and values made another way than :func:`own_projections`
    (:mod:`.stacked`), and then attended by :func:`attend_projected` where the step does not apply."""

    def __call__(self: Any, x: Any, mask: Optional[Any] = None, cache: Optional[Any] = None) -> Any:
        can = getattr(cache, "can_attend_step", None)
        if can is not None and backend.steps_attention(self.rope) and can(self.n_heads, x.shape[1], backend):
            out = cache.attend_step(*(project or own_projections)(self, x), self.n_heads, self.rope, self.scale, backend)
            return self.o_proj(out)
        if project is not None:
            return attend_projected(self, *project(self, x), mask, cache, backend.attend)
        return original(self, x, mask, cache)

    return functools.wraps(original)(__call__)  # (__wrapped__: what runs where the step does not apply)


def attend_projected(self: Any, queries: Any, keys: Any, values: Any, mask: Optional[Any], cache: Optional[Any],
                     attend: Callable[..., Any]) -> Any:
    """The rest of a :data:`_PLAIN_ATTENTION` ``__call__`` from its projections on (mlx-lm's
    code, line for line), ``attend`` as its ``scaled_dot_product_attention``."""
    B, L, _ = queries.shape
    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries = self.rope(queries)
        keys = self.rope(keys)
    output = attend(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))
