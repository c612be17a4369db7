"""Paged attention for the GPU: attention that reads K/V through the block tables, with no
gathered copy of the rows' blocks.

Two kernels whose threads never talk to each other (no shared memory, no barriers, no warp
shuffles), so the one body text of each runs as it is under MLX's ``mx.fast.cuda_kernel``, its
``mx.fast.metal_kernel`` and, in the tests, a C++ loop over the thread indices on the CPU
(the same text compiled by the system compiler):

1. **scores**: a thread per (row, KV head, query position, visible token) computes that
   token's score for each query head of its KV head's group (the token's K row read once for
   all of them), scaled; a token the position cannot see scores :data:`MASKED`;
2. the scores' softmax, by MLX's ops in float32 (with attention ``sinks``, gpt-oss's per-head
   logit, as one more column of each head's scores that takes its share and is dropped; with a
   ``softcap``, gemma2's, each visible score ``s`` becomes ``softcap * tanh(s / softcap)`` first);
3. **values**: a thread per (token split, row, KV head, query position, channel) sums its
   split's probabilities times V for the group's query heads (adjacent threads read adjacent
   channels of one V row); MLX's ``sum`` adds the splits.

Each query position sees the tokens before its limit (``limits``: a row's tokens for a
decode step; per position for a prefill piece or a verify step), and with a sliding
``window`` only the last ``window`` of them. Pools are ``(slots, kv_heads, D)`` with slot =
block * block_size + offset, as :mod:`...engine.kv.storage` holds them; float32, float16
or bfloat16, or quantized (int8 / int4 blocks: ``mx.quantize``'s packed codes, with a scale
and a bias per group of a head's channels, read and dequantized where each value is used).

:func:`paged_attention` is the whole computation over a ``launch`` callable that runs one
:class:`KernelCall` (the backend's: :mod:`.backends.gpu_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

import mlx.core as mx

from .softcap import softcapped_attention

MASKED = -1.0e30
"""A score no query position sees (finite: a padding position seeing nothing gets zeros, not NaN)."""
SPLIT_TOKENS = 256
"""Tokens one values thread sums: a 4,000-token row is 16 splits, so one row alone still fills the GPU."""
THREADGROUP = 256
MAX_GROUP = 16
"""Query heads per KV head a thread keeps accumulators for (more, and the group is attended in
parts of at most this many: each part reads the K/V rows again)."""
POOL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_SCORES = 1 << 26
"""Scores one launch of the kernels may hold (256 MiB of float32): a longer prefill piece, or
more rows over long contexts, is attended in parts of its positions (then rows), so the scores
never grow with the piece times the context."""

PARAMS = "params"
"""The run-time sizes both kernels read: ``(table width M, score width T, positions L, rows B,
split tokens, splits)``: they change every step, so they are an input, not a template constant
(one compiled kernel per model layout, not per step)."""

SCORES_BODY = """
    constexpr int GROUP = HEADS / KV_HEADS;
    const int M_ = params[0], T_ = params[1], L_ = params[2], B_ = params[3];
    if (tid >= B_ * KV_HEADS * L_ * T_) return;
    const int j = tid % T_;
    int r = tid / T_;
    const int l = r % L_;
    r /= L_;
    const int h = r % KV_HEADS;
    const int b = r / KV_HEADS;
    const int end = limits[b * L_ + l];
    const int start = (WINDOW > 0 && end > WINDOW) ? end - WINDOW : 0;
    const int t = start + j;
    const idx_t out0 = ((idx_t)(b * HEADS + h * GROUP) * L_ + l) * T_ + j;
    const idx_t head_stride = (idx_t)L_ * T_;
    if (t >= end) {
        for (int g = 0; g < GROUP; ++g) scores[out0 + g * head_stride] = -1.0e30f;
        return;
    }
    const idx_t block = table[b * M_ + t / BLOCK];
    const idx_t row = (block * BLOCK + t % BLOCK) * KV_HEADS + h;
    const idx_t q0 = ((idx_t)(b * HEADS + h * GROUP) * L_ + l) * HEAD_DIM;
    const idx_t q_stride = (idx_t)L_ * HEAD_DIM;
    float acc[GROUP];
    for (int g = 0; g < GROUP; ++g) acc[g] = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float k = READ_K;
        for (int g = 0; g < GROUP; ++g) acc[g] += static_cast<float>(queries[q0 + g * q_stride + d]) * k;
    }
    for (int g = 0; g < GROUP; ++g) scores[out0 + g * head_stride] = acc[g] * scale[0];
"""

VALUES_BODY = """
    constexpr int GROUP = HEADS / KV_HEADS;
    const int M_ = params[0], T_ = params[1], L_ = params[2], B_ = params[3], SPLIT = params[4], SPLITS = params[5];
    if (tid >= SPLITS * B_ * KV_HEADS * L_ * HEAD_DIM) return;
    const int d = tid % HEAD_DIM;
    int r = tid / HEAD_DIM;
    const int l = r % L_;
    r /= L_;
    const int h = r % KV_HEADS;
    r /= KV_HEADS;
    const int b = r % B_;
    const int s = r / B_;
    const int end = limits[b * L_ + l];
    const int start = (WINDOW > 0 && end > WINDOW) ? end - WINDOW : 0;
    const int j0 = s * SPLIT;
    int j1 = end - start;
    if (j1 > j0 + SPLIT) j1 = j0 + SPLIT;
    const idx_t p0 = ((idx_t)(b * HEADS + h * GROUP) * L_ + l) * T_;
    const idx_t head_stride = (idx_t)L_ * T_;
    float acc[GROUP];
    for (int g = 0; g < GROUP; ++g) acc[g] = 0.0f;
    for (int j = j0; j < j1; ++j) {
        const int t = start + j;
        const idx_t block = table[b * M_ + t / BLOCK];
        const idx_t row = (block * BLOCK + t % BLOCK) * KV_HEADS + h;
        const float v = READ_V;
        for (int g = 0; g < GROUP; ++g) acc[g] += probs[p0 + g * head_stride + j] * v;
    }
    const idx_t o0 = ((((idx_t)s * B_ + b) * HEADS + h * GROUP) * L_ + l) * HEAD_DIM + d;
    const idx_t o_stride = (idx_t)L_ * HEAD_DIM;
    for (int g = 0; g < GROUP; ++g) partial[o0 + g * o_stride] = acc[g];
"""


FLOAT_READ = "static_cast<float>({x}_pool[row * HEAD_DIM + d])"
"""Channel ``d`` of pool row ``row`` (a token's head) of a float pool."""
QUANTIZED_READ = (
    "(static_cast<float>(({x}_pool[row * (HEAD_DIM * BITS / 32) + d / (32 / BITS)] >> ((d % (32 / BITS)) * BITS))"
    " & ((1u << BITS) - 1u)) * static_cast<float>({x}_scales[row * (HEAD_DIM / QGROUP) + d / QGROUP])"
    " + static_cast<float>({x}_biases[row * (HEAD_DIM / QGROUP) + d / QGROUP]))"
)
"""The same of a quantized pool: ``mx.quantize``'s code (``32 / BITS`` to a word, the lowest
bits first) times its group's scale plus its bias."""


@dataclass(frozen=True)
class KernelSource:
    """One kernel as MLX's ``fast.*_kernel`` takes it: inputs, outputs and body (the body
    reads its thread's index as ``tid`` and 64-bit offsets as ``idx_t``: :func:`body_for`)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: str


SCORES = KernelSource("parallm_paged_scores", ("queries", "k_pool", "table", "limits", PARAMS, "scale"), ("scores",),
                      SCORES_BODY.replace("READ_K", FLOAT_READ.format(x="k")))
VALUES = KernelSource("parallm_paged_values", ("probs", "v_pool", "table", "limits", PARAMS), ("partial",),
                      VALUES_BODY.replace("READ_V", FLOAT_READ.format(x="v")))
QUANTIZED_SCORES = KernelSource("parallm_paged_scores_q", ("queries", "k_pool", "k_scales", "k_biases", "table", "limits", PARAMS, "scale"),
                                ("scores",), SCORES_BODY.replace("READ_K", QUANTIZED_READ.format(x="k")))
QUANTIZED_VALUES = KernelSource("parallm_paged_values_q", ("probs", "v_pool", "v_scales", "v_biases", "table", "limits", PARAMS),
                                ("partial",), VALUES_BODY.replace("READ_V", QUANTIZED_READ.format(x="v")))
QUANTIZED_BITS = (8, 4)
QUANTIZED_GROUP = 32
"""Channels sharing a scale and bias in the pools :func:`quantize_pools` makes (the KV storage's group)."""

THREAD_INDEX = {
    "cuda": "blockIdx.x * blockDim.x + threadIdx.x",
    "metal": "thread_position_in_grid.x",
    "cpu": "thread_index",
}
"""How each place the bodies run names a thread's index in the grid (MLX launches one thread a grid index, rounded up to whole threadgroups)."""
INDEX_TYPE = {"cuda": "long long", "metal": "long", "cpu": "long long"}  # Metal has no ``long long``; its ``long`` is 64-bit


def body_for(kernel: KernelSource, where: str) -> str:
    """``kernel``'s body for ``where`` (``"cuda"``, ``"metal"`` or ``"cpu"``)."""
    return f"    typedef {INDEX_TYPE[where]} idx_t;\n    const int tid = (int)({THREAD_INDEX[where]});\n" + kernel.body


@dataclass(frozen=True)
class Layout:
    """What one compiled kernel pair is specialised for: a model layer's head layout, the
    pool's dtype and block size, a sliding window (0: none); quantized pools: their bits, the
    channels a scale covers and the scales' dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    window: int
    dtype: mx.Dtype
    bits: int = 0
    group: int = 0
    scales_dtype: Optional[mx.Dtype] = None

    def template(self) -> list[tuple[str, object]]:
        """The template arguments both kernels take (``Tk``: the pool's element type)."""
        common = [("Tk", self.dtype), ("HEADS", self.heads), ("KV_HEADS", self.kv_heads), ("HEAD_DIM", self.head_dim),
                  ("BLOCK", self.block_size), ("WINDOW", self.window)]
        return common + ([("BITS", self.bits), ("QGROUP", self.group), ("Ts", self.scales_dtype)] if self.bits else [])


@dataclass
class KernelCall:
    """One launch: ``kernel`` over ``inputs`` (in ``kernel.inputs``' order), ``threads`` grid
    indices, one output of ``output_shape`` in float32."""

    kernel: KernelSource
    layout: Layout
    inputs: list[mx.array]
    threads: int
    output_shape: tuple[int, ...]


Launch = Callable[[KernelCall], mx.array]


def takes(queries: mx.array, k_pool: mx.array, v_pool: mx.array, lengths: mx.array,
          scales: Optional[Sequence[mx.array]] = None, bits: int = 0) -> bool:
    """Whether :func:`paged_attention` takes these: pools of one shape and dtype, float or
    quantized (``bits`` in :data:`QUANTIZED_BITS`, ``scales`` the K scales and biases then the
    V ones, a group of channels dividing the head), whole groups of query heads per KV head,
    limits per row or per position."""
    B, heads, L, D = queries.shape
    if k_pool.ndim != 3 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        return False
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or lengths.shape not in ((B,), (B, L)) or (L > 1 and lengths.ndim != 2):
        return False
    if not bits and scales is None:
        return k_pool.dtype in POOL_DTYPES and k_pool.shape[2] == D
    if bits not in QUANTIZED_BITS or scales is None or len(scales) != 4 or k_pool.dtype != mx.uint32:
        return False
    groups = scales[0].shape[-1] if scales[0].ndim == 3 else 0
    shape = (k_pool.shape[0], kv_heads, groups)
    return (k_pool.shape[2] * 32 == D * bits and groups > 0 and D % groups == 0 and all(s.shape == shape for s in scales)
            and len({s.dtype for s in scales}) == 1 and scales[0].dtype in POOL_DTYPES)


def paged_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int,
                    scale: float, launch: Launch, window: Optional[int] = None, max_scores: int = MAX_SCORES,
                    sinks: Optional[mx.array] = None, scales: Optional[Sequence[mx.array]] = None, bits: int = 0,
                    softcap: Optional[float] = None) -> mx.array:
    """Attention of ``queries`` ``(B, heads, L, D)`` over paged K/V by the two kernels (the
    module docstring), each run by ``launch``: ``table`` ``(B, M)`` block ids, ``lengths``
    ``(B,)`` or ``(B, L)`` the tokens each position sees (where :func:`takes`), ``sinks``
    ``(heads,)`` attention sinks or None, quantized pools' ``scales`` (K scales, K biases, V
    scales, V biases) and ``bits``, ``softcap`` the scores' cap or None; ``(B, heads, L, D)``
    in ``queries``' dtype. Parts of at most ``max_scores`` scores are attended one by one."""
    B, heads, L, D = queries.shape
    M = table.shape[1]
    T = M * block_size if not window else min(M * block_size, window)
    # one position a row: the row's limit is the position's, as the kernels index it (no op to build)
    limits = lengths.astype(mx.int32) if L == 1 and lengths.shape == (B,) else _per_position(lengths, B, L)
    table = table.astype(mx.int32)
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    if group > MAX_GROUP:  # each KV head's query heads in parts of at most MAX_GROUP
        grouped = queries.reshape(B, kv_heads, group, L, D)
        outs = []
        for lo in range(0, group, MAX_GROUP):
            part = slice(lo, min(lo + MAX_GROUP, group))
            n = part.stop - lo
            part_sinks = None if sinks is None else sinks.reshape(kv_heads, group)[:, part].reshape(-1)
            out = paged_attention(grouped[:, :, part].reshape(B, kv_heads * n, L, D), k_pool, v_pool, table, limits, block_size,
                                  scale, launch, window, max_scores, part_sinks, scales, bits, softcap)
            outs.append(out.reshape(B, kv_heads, n, L, D))
        return mx.concatenate(outs, axis=2).reshape(B, heads, L, D)
    if B * heads * L * T > max_scores and (L > 1 or B > 1):
        def part(lo: slice, rows: slice) -> mx.array:
            seen = limits[rows] if limits.ndim == 1 else limits[rows, lo]
            return paged_attention(queries[rows, :, lo], k_pool, v_pool, table[rows], seen, block_size, scale,
                                   launch, window, max_scores, sinks, scales, bits, softcap)
        if L > 1:
            half = slice(0, L // 2), slice(L // 2, L)
            return mx.concatenate([part(lo, slice(None)) for lo in half], axis=2)
        half = slice(0, B // 2), slice(B // 2, B)
        return mx.concatenate([part(slice(None), rows) for rows in half], axis=0)
    return _attend(queries, k_pool, v_pool, table, limits, block_size, scale, launch, window, T, sinks, scales, bits, softcap)


def _attend(queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, limits: mx.array, block_size: int,
            scale: float, launch: Launch, window: Optional[int], T: int, sinks: Optional[mx.array],
            scales: Optional[Sequence[mx.array]], bits: int, softcap: Optional[float]) -> mx.array:
    """One launch of each kernel over every row and position (:func:`paged_attention`'s)."""
    B, heads, L, D = queries.shape
    M = table.shape[1]
    splits = -(-T // SPLIT_TOKENS)
    if bits:
        layout = Layout(heads, k_pool.shape[1], D, block_size, window or 0, k_pool.dtype, bits, D // scales[0].shape[-1], scales[0].dtype)
        (scores_kernel, values_kernel), k_in, v_in = (QUANTIZED_SCORES, QUANTIZED_VALUES), [k_pool, *scales[:2]], [v_pool, *scales[2:]]
    else:
        layout = Layout(heads, k_pool.shape[1], D, block_size, window or 0, k_pool.dtype)
        (scores_kernel, values_kernel), k_in, v_in = (SCORES, VALUES), [k_pool], [v_pool]
    params = _constant((M, T, L, B, SPLIT_TOKENS, splits), mx.int32)
    kv_heads = layout.kv_heads
    scores = launch(KernelCall(scores_kernel, layout, [queries, *k_in, table, limits, params, _constant((scale,), mx.float32)],
                               B * kv_heads * L * T, (B, heads, L, T)))
    probs = _probabilities(scores, sinks, softcap)
    partial = launch(KernelCall(values_kernel, layout, [probs, *v_in, table, limits, params], splits * B * kv_heads * L * D,
                                (splits, B, heads, L, D)))
    summed = partial.squeeze(0) if splits == 1 else partial.sum(axis=0)  # (one split: a view, no reduction to launch)
    return summed.astype(queries.dtype)


def _probabilities(scores: mx.array, sinks: Optional[mx.array], softcap: Optional[float]) -> mx.array:
    """The softmax of float32 ``scores`` ``(B, heads, L, T)`` whose unseen tokens score
    :data:`MASKED`: each seen score capped first (``softcap``), each head's sink logit taking
    a share and giving no value (``sinks``, ``(heads,)``)."""
    if softcap is not None:  # (unseen tokens keep their MASKED score: capped, they would count)
        scores = mx.where(scores > MASKED / 2, mx.tanh(scores / softcap) * softcap, scores)
    if sinks is None:
        return mx.softmax(scores, axis=-1, precise=True)
    B, heads, L, T = scores.shape
    sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, heads, 1, 1), (B, heads, L, 1))
    return mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :T]


def quantize_pools(k_pool: mx.array, v_pool: mx.array, bits: int) -> tuple[mx.array, mx.array, list[mx.array]]:
    """Float pools quantized as the KV storage quantizes blocks (``mx.quantize`` of their
    float16 values, :data:`QUANTIZED_GROUP` channels a group): the K codes, the V codes, and
    the ``scales`` :func:`paged_attention` takes (K scales, K biases, V scales, V biases)."""
    (kc, ks, kb), (vc, vs, vb) = (mx.quantize(p.astype(mx.float16), group_size=QUANTIZED_GROUP, bits=bits) for p in (k_pool, v_pool))
    return kc, vc, [ks, kb, vs, vb]


def _per_position(lengths: mx.array, B: int, L: int) -> mx.array:
    """The tokens each query position sees, ``(B, L)`` int32, from ``lengths`` per row or per position."""
    limits = lengths.reshape(B, L) if lengths.ndim == 2 else mx.broadcast_to(lengths.reshape(B, 1), (B, L))
    return limits.astype(mx.int32)


@lru_cache(maxsize=256)
def _constant(values: tuple, dtype: mx.Dtype) -> mx.array:
    """A small constant input, made once: every layer of a step passes the same ones, and
    each new array would be one more copy to the device."""
    return mx.array(values, dtype=dtype)


def gathered_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int,
                       scale: float, window: Optional[int] = None, sinks: Optional[mx.array] = None,
                       scales: Optional[Sequence[mx.array]] = None, bits: int = 0, softcap: Optional[float] = None,
                       exact: bool = False) -> mx.array:
    """The same attention by gathering every row's blocks (dequantized by ``mx.dequantize``,
    in float32) and MLX's ops (the reference the kernels are checked against, and what
    :func:`paged_attention` computes). ``exact``: products and sums by elementwise ops and
    reductions, never a matmul, which MLX runs in TF32 on CUDA and Metal by default
    (``MLX_ENABLE_TF32``): about 3 significant digits, where the kernels compute in float32."""
    B, heads, L, D = queries.shape
    M = table.shape[1]
    S = M * block_size
    slots = (table[:, :, None] * block_size + mx.arange(block_size)[None, None, :]).reshape(B, S)

    def by_head(a: mx.array) -> mx.array:  # (kv_heads, B, S, ...): gathered head by head, as the engine's gather path reads
        return a.swapaxes(0, 1)[:, slots]

    if bits:  # in float32, as the kernels dequantize
        group = D // scales[0].shape[-1]
        ks, kb, vs, vb = (by_head(a).astype(mx.float32) for a in scales)
        k = mx.dequantize(by_head(k_pool), ks, kb, group_size=group, bits=bits)
        v = mx.dequantize(by_head(v_pool), vs, vb, group_size=group, bits=bits)
    else:
        k, v = by_head(k_pool), by_head(v_pool)
    k = k.astype(mx.float32).swapaxes(0, 1)  # (B, kv_heads, S, D)
    v = v.astype(mx.float32).swapaxes(0, 1)
    limits = _per_position(lengths, B, L)
    pos = mx.arange(S)[None, None, :]
    end = limits[:, :, None]
    visible = pos < end
    if window:
        visible = visible & (pos >= end - window)
    mask = visible[:, None, :, :]  # (B, 1, L, S)
    if exact:
        return _exact_attention(queries.astype(mx.float32), k, v, scale, mask, sinks, softcap).astype(queries.dtype)
    if softcap is not None:
        return softcapped_attention(queries.astype(mx.float32), k, v, scale, mask, softcap).astype(queries.dtype)
    extra = {} if sinks is None else {"sinks": sinks.astype(mx.float32)}
    out = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), k, v, scale=scale, mask=mask, **extra)
    return out.astype(queries.dtype)


def _exact_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array,
                     sinks: Optional[mx.array], softcap: Optional[float]) -> mx.array:
    """Attention of float32 ``queries`` (B, heads, L, D) over ``keys`` / ``values`` (B,
    kv_heads, S, D) seen where ``mask`` (B, 1, L, S), by broadcast products and sums (small
    inputs only: it holds every product)."""
    B, heads, L, D = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    S = keys.shape[2]
    q = queries.reshape(B, kv_heads, group, L, 1, D)
    scores = (q * keys[:, :, None, None]).sum(axis=-1) * scale  # (B, kv_heads, group, L, S)
    scores = mx.where(mask, scores.reshape(B, heads, L, S), MASKED)
    probs = _probabilities(scores, sinks, softcap).reshape(B, kv_heads, group, L, S)
    out = (probs[..., None] * values[:, :, None, None]).sum(axis=-2)  # (B, kv_heads, group, L, D)
    return out.reshape(B, heads, L, D)
