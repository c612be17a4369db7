"""gemma2's attention through its backend. mlx-lm's ``gemma2.Attention`` computes its
softcapped scores itself (no ``scaled_dot_product_attention`` to route), so its routed
``__call__`` is this module's: the same projections, RoPE and cache write, then the backend's
``attend`` with the layer's ``softcap``: the paged KV read through the block tables (the GPU
kernels cap the scores between their two kernels) instead of every row's blocks gathered
into one rectangle per layer for mlx-lm's code.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .attention_step import plain_code

_SOFTCAPPED = (("mlx_lm.models.gemma2", "Attention"),)
"""mlx-lm attention classes whose ``__call__`` is q/k/v projections, RoPE at ``cache.offset``,
``cache.update_and_fetch``, attention with scores ``softcap * tanh(scores / softcap)`` at
``self.scale`` (``attn_logit_softcapping``) and ``o_proj``, with ``n_heads`` / ``n_kv_heads``."""


def softcapped(cls: type) -> bool:
    """Whether ``cls``'s ``__call__`` is one of :data:`_SOFTCAPPED`'s."""
    return plain_code(cls, _SOFTCAPPED)


def attending(backend: Any) -> Callable[..., Any]:
    """The routed ``__call__`` of a :func:`softcapped` class: its attention by ``backend.attend``."""

    def __call__(self: Any, x: Any, mask: Optional[Any] = None, cache: Optional[Any] = None) -> Any:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        out = backend.attend(queries, keys, values, cache, self.scale, mask, softcap=self.attn_logit_softcapping)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return __call__
