"""A llama (or qwen2) decoder layer's step of up to 128 rows (rows x positions: a decode or
verify step, a short prefill piece) as one op: the routed ``__call__`` of mlx-lm's llama and
qwen2 ``TransformerBlock``.

Each MLX op on the CPU costs ~15 us beside its work (its task goes to the stream's thread,
which sleeps between small ops): a one-row step of the default model was ~320 such ops after
the fused attention step (:mod:`.attention_step`), ~5 ms of its ~15. Where the layer is the
plain llama shape this package's kernels compute (fused RMSNorms, q/k/v and gate/up as packed
sibling weights, o and down packed, no biases but q/k/v's (qwen2's), a plain RoPE), the step
has at most :data:`MAX_ROWS` rows, and the cache takes a fused step, the block is one op
(``kernels/decoder_layer.cpp``) that calls the same kernels in the same order: the same
numbers, bit for bit. Everywhere else mlx-lm's block runs as routed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from ..lora.layers import base_linear, blocks_step_fused
from .attention_step import fusable, original_class, plain_code
from .stacked import PLAIN_MLPS

_PLAIN_BLOCKS = (("mlx_lm.models.llama", "TransformerBlock"), ("mlx_lm.models.qwen2", "TransformerBlock"))
"""mlx-lm blocks whose ``__call__`` is ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""
MAX_ROWS = 128
"""Most rows (rows x positions) a step takes through the op: the packed kernel's panels' bound."""


def fusable_block(cls: type) -> bool:
    """Whether ``cls``'s ``__call__`` is one of :data:`_PLAIN_BLOCKS`'."""
    return plain_code(cls, _PLAIN_BLOCKS)


@dataclass(frozen=True)
class LayerPlan:
    """What the decoder-layer op takes of one block: its norms and four packed weights
    (q/k/v, o, gate/up, down: bytes, scales and biases each, with their bits and groups)."""

    w_in: mx.array
    eps_in: float
    w_post: mx.array
    eps_post: float
    weights: tuple[mx.array, ...]
    bits: tuple[int, ...]
    groups: tuple[int, ...]
    copies: bool
    """Whether a layer keeps a float32 copy of its weight (steps wider than the packed kernel's
    rows then multiply by it through OpenBLAS, which the op does not)."""
    qkv_bias: Optional[mx.array] = None
    """q, k and v's biases, concatenated (qwen2), or None."""


def _packed(layers: list[Any], ext: Any, biased: bool = False) -> Optional[Any]:
    """The packed weight that ``layers`` (SmallBatchLinear; with a bias each where ``biased``,
    else none) take whole, in order, or None."""
    from ..small_batch import SmallBatchLinear

    if not all(type(layer) is SmallBatchLinear and ("bias" in layer) == biased for layer in layers):
        return None
    source = layers[0]._source
    if any(layer._source is not source for layer in layers) or source.kernel is not ext:
        return None
    edges = [0] + [layer._columns[1] for layer in layers]
    if [layer._columns[0] for layer in layers] != edges[:-1] or edges[-1] != source.packed.shape[0]:
        return None
    return source.packed


def plan_of(block: Any) -> Optional[LayerPlan]:
    """``block``'s :class:`LayerPlan`, or None where it is not the plain llama layer the op computes."""
    from .. import qmatmul_ext
    from ..fused_ops import FusedRMSNorm, FusedRoPE

    ext = qmatmul_ext.load()
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    norms = (getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None))
    if ext is None or not hasattr(ext, "decoder_layer") or attn is None or mlp is None:
        return None
    if not all(type(n) is FusedRMSNorm for n in norms) or not isinstance(getattr(attn, "rope", None), FusedRoPE):
        return None
    if not fusable(original_class(attn)) or not plain_code(original_class(mlp), PLAIN_MLPS):
        return None
    q, k, v, o, gate, up, down = (base_linear(layer) for layer in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                                  mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    qkv = [q, k, v]
    linears = [*qkv, o, gate, up, down]
    biased = "bias" in q
    parts = [_packed(qkv, ext, biased), _packed([o], ext), _packed([gate, up], ext), _packed([down], ext)]
    if any(p is None for p in parts):
        return None
    qkv_bias = mx.concatenate([layer.bias.astype(mx.float32) for layer in qkv]) if biased else None
    return LayerPlan(norms[0].weight, float(norms[0].eps), norms[1].weight, float(norms[1].eps),
                     tuple(a for p in parts for a in (p.packed, p.scales, p.biases)), tuple(p.bits for p in parts),
                     tuple(p.group_size for p in parts), any("weight" in layer for layer in linears), qkv_bias)


def stepping_block(original: Callable[..., Any], backend: Any) -> Callable[..., Any]:
    """``original`` (a block's ``__call__``) with the one-op layer step in front."""

    def __call__(self: Any, x: Any, mask: Optional[Any] = None, cache: Optional[Any] = None) -> Any:
        out = backend.layer_step(self, x, cache) if blocks_step_fused(self) else None  # (rows with adapters: layer by layer)
        return out if out is not None else original(self, x, mask, cache)

    return functools.wraps(original)(__call__)
