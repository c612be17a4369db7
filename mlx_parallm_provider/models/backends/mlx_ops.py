"""The backend of MLX's own ops: what a model runs where no CPU kernel applies (Metal, CUDA,
``DeviceConfig.cpu_kernels=False``), and the base class every backend extends."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import mlx.core as mx

from ..softcap import softcapped_attention
from .routing import mlx_lm_attention, mlx_lm_swiglu


class MLXOps:
    """MLX's own ops for one loaded model's attention, SwiGLU, norms, RoPE and linear layers.

    A backend is chosen once per model (:func:`.choose`) and held by the model's layers
    (:func:`.install`); the engine's caches reach it as the ``backend`` argument of their
    ``attend``. Class attributes declare what it supports."""

    name = "mlx"
    kernels = False
    """Whether it runs this package's CPU kernels (the packed-weight matmul, the fused
    decode attention, RMSNorm and RoPE)."""
    reads_pages = False
    """Whether :meth:`paged_decode_attention` may read paged KV through the block tables (else
    the caller gathers the rows' blocks without asking)."""
    head_sizes: Optional[tuple[int, int, int]] = None
    """``(multiple, largest, largest query heads per KV head)`` its decode kernels take; None: any."""
    packed_rows = 0
    """Inputs of at most this many rows multiply by packed weights (:mod:`..small_batch`); 0: never."""
    qmatmul_threads = 1
    int8_matmul = False
    """Quantized layers multiply every row count with activations quantized in blocks of 32 and
    integer dot products (:mod:`..small_batch`)."""
    activation_bits = 8
    """Those activations' bits with ``int8_matmul``: 8 (int8) or 16 (two int8 planes)."""
    float32_weights = False
    """Quantized layers keep float32 copies of their weights for large steps (:mod:`..small_batch`)."""
    steps_layers = False
    """Whether :meth:`layer_step` may take a decoder layer's whole step (else the layers keep
    their own ``__call__``, with no wrapper to ask)."""
    folds_rows = False
    """Whether the model's quantized linear layers (and a quantized embedding used as the
    output head) multiply a step's rows as one ``(rows, K)`` matrix rather than as one
    problem per row, as MLX's CUDA backend takes ``(rows, 1, K)`` (:mod:`.folded_rows`)."""
    stacks_siblings = True
    """Whether a plain llama / qwen2 block's q/k/v and gate/up, quantized alike, are stacked at
    load (:attr:`.DeviceConfig.stack_projections`) and each multiplied as one product (:mod:`.stacked`)."""
    step_writes_in_place = True
    """Whether :meth:`paged_attention_step` writes the pools' memory in place (an op MLX does
    not see writing: the pools' later readers are then ordered after it), rather than by
    indexed assignment to the pools it is handed (MLX's scatter, which replaces them)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def attention_path(self) -> str:
        """How this backend attends over paged KV, in words (``mlx-parallm doctor``, ``Engine.stats()``)."""
        return "gather (MLX's ops)"

    # -- attention ----------------------------------------------------------------------

    def attend(self, queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Optional[Any], sinks: Optional[Any] = None,
               softcap: Optional[float] = None) -> Any:
        """mlx-lm's ``scaled_dot_product_attention`` as the model's layers call it: the
        cache's own ``attend(queries, keys, values, scale=, mask=, backend=)`` where it has
        one (with ``sinks=`` where the cache declares ``attends_sinks``), mlx-lm's function
        for quantized caches and for attention sinks elsewhere, else :meth:`dense_attention`.
        ``softcap`` (gemma2's routed attention, :mod:`.softcapped`): the cache's ``attend``
        with ``softcap=`` where it declares ``attends_softcap``, else :meth:`dense_attention`."""
        own = getattr(cache, "attend", None)
        if softcap is not None:
            if own is not None and getattr(cache, "attends_softcap", False):
                return own(queries, keys, values, scale=scale, mask=mask, backend=self, softcap=softcap)
            if hasattr(cache, "bits"):  # mlx-lm's quantized cache: (codes, scales, biases) each
                keys, values = (mx.dequantize(*kv, group_size=cache.group_size, bits=cache.bits) for kv in (keys, values))
            return self.dense_attention(queries, keys, values, scale=scale, mask=mask, softcap=softcap)
        if sinks is not None and own is not None and getattr(cache, "attends_sinks", False):
            return own(queries, keys, values, scale=scale, mask=mask, backend=self, sinks=sinks)
        if sinks is not None or hasattr(cache, "bits"):
            return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if own is not None:
            return own(queries, keys, values, scale=scale, mask=mask, backend=self)
        return self.dense_attention(queries, keys, values, scale=scale, mask=mask)

    def dense_attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any],
                        sinks: Optional[mx.array] = None, softcap: Optional[float] = None) -> mx.array:
        """Plain attention: ``queries`` (B, heads, L, D) over ``keys`` / ``values`` (B,
        kv_heads, S, D), ``mask`` as mlx-lm passes it (None, ``"causal"`` or an array);
        ``sinks`` (heads,): gpt-oss's per-head logit that takes a share of the softmax;
        ``softcap``: gemma2's cap on the scores (:func:`..softcap.softcapped_attention`)."""
        if softcap is not None:
            return softcapped_attention(queries, keys, values, scale, mask, softcap)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def decode_attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[Any]) -> Optional[mx.array]:
        """One query position per row through a fused kernel, or None: use MLX's ops."""
        return None

    def paged_decode_attention(
        self, queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int, scale: float,
        window: Optional[int] = None, scales: Optional[Sequence[mx.array]] = None, bits: int = 0,
        sinks: Optional[mx.array] = None, softcap: Optional[float] = None,
    ) -> Optional[mx.array]:
        """Attention over paged KV through a fused kernel (a sliding ``window``: each position
        sees its last ``window`` tokens; quantized pools: their ``scales`` and ``bits``;
        ``sinks``: gpt-oss's per-head attention sinks; ``softcap``: gemma2's cap on the
        scores), or None: the caller gathers the rows' blocks (see
        :func:`..attention.paged_decode_attention`)."""
        return None

    def steps_attention(self, rope: Any) -> bool:
        """Whether :meth:`paged_attention_step` takes a step of an attention whose RoPE is ``rope``."""
        return False

    def fits_attention_step(self, heads: int, k_pool: mx.array, scales: Optional[Sequence[mx.array]], bits: int) -> bool:
        """Whether :meth:`paged_attention_step` takes ``heads`` query heads over ``k_pool``
        ``(slots, kv_heads, D)`` (quantized pools: their ``scales`` and ``bits``)."""
        return False

    def paged_attention_step(self, queries: mx.array, keys: mx.array, values: mx.array, k_pool: mx.array, v_pool: mx.array,
                             slots: mx.array, table: mx.array, limits: mx.array, offset: mx.array, heads: int, rope: Any,
                             block_size: int, scale: float, scales: Optional[Sequence[mx.array]] = None) -> mx.array:
        """A decode or verify step's attention block as one op, or as few as the backend can
        (see :mod:`.attention_step`): ``queries`` (B, L, heads * D) and ``keys`` rotated by
        ``rope`` at positions ``offset[b] + j``, the new keys and values written into the pools
        at ``slots`` (see :attr:`step_writes_in_place`), then attention over the block ``table`` up to ``limits`` (as
        :meth:`paged_decode_attention`); (B, L, heads * D). ``scales``: quantized pools' (their
        codes, scales and biases written as the storage writes them). Only where :meth:`steps_attention`
        and :meth:`fits_attention_step`."""
        raise NotImplementedError(f"{type(self).__name__} has no fused attention step")

    def layer_step(self, block: Any, x: mx.array, cache: Any) -> Optional[mx.array]:
        """A decoder layer's whole step as one op (see :mod:`.layer_step`), or None: run the
        block's own code."""
        return None

    def log_softmax(self, rows: mx.array) -> Optional[mx.array]:
        """``rows - mx.logsumexp(rows, axis=-1, keepdims=True)`` for ``rows`` ``(n, vocab)`` as
        one op giving what MLX's ops give; or None: the engine computes it with MLX's ops."""
        return None

    def top_tokens(self, rows: mx.array, k: int) -> Optional[mx.array]:
        """Each row's ``k`` largest values' indices as one op, ``(n, k)``, the largest first (of
        equal values the lower index first); or None: the engine takes MLX's ``argpartition``
        row by row."""
        return None

    def filter_rows(self, logprobs: mx.array, top_p: Sequence[float], min_p: Sequence[float], top_k: Sequence[int]) -> Optional[mx.array]:
        """Sampled rows' filters as one op: mlx-lm's ``apply_top_p``, ``apply_min_p`` and
        ``apply_top_k``, in that order, over each row of ``logprobs`` ``(n, vocab)`` with its
        own settings (off: ``top_p`` 1, ``min_p`` 0, ``top_k`` 0); or None: the engine filters
        them with mlx-lm's functions (:func:`...engine.sampling.filter_rows`)."""
        return None

    def gumbel_draw(self, rows: mx.array, keys: mx.array) -> Optional[mx.array]:
        """Sampled rows' Gumbel-max draws as one op: each row's ``argmax(rows[i] +
        mx.random.gumbel(rows[i].shape, key=keys[i]))``, ``(n,)`` uint32, for ``rows`` ``(n,
        vocab)`` and ``keys`` ``(n, 2)``; or None: the engine draws with MLX's ops."""
        return None

    # -- elementwise ----------------------------------------------------------------------

    def exp(self, x: mx.array) -> mx.array:
        """``exp`` as the engine's cascade attention takes it."""
        return mx.exp(x)

    def swiglu(self, gate: mx.array, x: mx.array) -> mx.array:
        """``silu(gate) * x`` (mlx-lm's ``swiglu``)."""
        return mlx_lm_swiglu(gate, x)

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array:
        """``nn.RMSNorm``'s computation."""
        return mx.fast.rms_norm(x, weight, eps)

    def rope(self, x: mx.array, dims: int, traditional: bool, base: float, scale: float, offset: Union[int, mx.array], freqs: Any) -> mx.array:
        """``nn.RoPE``'s computation (``freqs``: the inverse frequencies, for a kernel that takes them)."""
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)

    # -- load time ------------------------------------------------------------------------

    def adapt_quantized(self, model: Any) -> None:
        """Replace layers of a quantized model that this backend computes its own way, before
        mlx-lm's ``dequantize_model`` dequantizes the rest (nothing here)."""
