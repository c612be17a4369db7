"""The GPU backend: MLX's own ops, with attention over paged KV read through the block tables
by this package's kernels (:mod:`..paged_kernels`) instead of gathered into a copy per layer.

The kernels are compiled for the backend's platform only, by MLX's ``mx.fast.cuda_kernel``
(MLX's CUDA backend) or ``mx.fast.metal_kernel`` (Apple GPUs), when first used. That first
use also checks them: a small random pool attended by the kernels and by the gather path must
agree (the quantized pools' kernels are checked apart, at the first quantized use). With
:attr:`.DeviceConfig.paged_attention` ``"auto"`` a kernel that fails to compile or to agree is
logged once and the gather path is used from then on; ``"kernel"`` raises instead,
``"gather"`` never tries them.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import mlx.core as mx

from ...config import DeviceConfig
from .. import paged_kernels
from ..device import gpu_platform
from ..paged_kernels import KernelCall, Launch, body_for
from .mlx_ops import MLXOps

logger = logging.getLogger(__name__)

CHECK_TOLERANCE = 2e-3
"""Largest difference the first-use check allows between the kernels and the gather path (float32 pools)."""
CHECK_TOLERANCE_16BIT = 1 / 64
"""The same for float16 / bfloat16 queries and pools, relative (times 1 + the value's size):
both paths round their float32 results to 16 bits, where two sums that differ in their last
float32 bits can round one bfloat16 unit apart (1/128 of the value at most); a misread value
parts them by the value's size."""


class MLXKernels:
    """Runs :class:`~..paged_kernels.KernelCall` s through MLX's custom-kernel API of one
    platform, each kernel made once (MLX compiles it per template, on first launch)."""

    def __init__(self, platform: str) -> None:
        if platform not in ("cuda", "metal"):
            raise ValueError(f"no GPU kernels for platform {platform!r}: expected 'cuda' or 'metal'")
        self.platform = platform
        self._kernels: dict[str, Any] = {}

    def __call__(self, call: KernelCall) -> mx.array:
        kernel = self._kernels.get(call.kernel.name)
        if kernel is None:
            make = mx.fast.cuda_kernel if self.platform == "cuda" else mx.fast.metal_kernel
            kernel = make(name=call.kernel.name, input_names=list(call.kernel.inputs), output_names=list(call.kernel.outputs),
                          source=body_for(call.kernel, self.platform))
            self._kernels[call.kernel.name] = kernel
        return kernel(inputs=call.inputs, template=call.layout.template(), grid=(call.threads, 1, 1),
                      threadgroup=(paged_kernels.THREADGROUP, 1, 1), output_shapes=[call.output_shape],
                      output_dtypes=[mx.float32])[0]


class GPUKernels(MLXOps):
    """MLX's ops, paged attention by this package's kernels (see the module docstring).

    ``launch`` runs the kernels (default: :class:`MLXKernels` for ``platform``, itself
    :func:`gpu_platform` by default); the tests pass one that runs the same kernel text on the CPU."""

    name = "gpu"
    reads_pages = True
    step_writes_in_place = False
    folds_rows = True

    def __init__(self, device: Optional[DeviceConfig] = None, launch: Optional[Launch] = None, platform: Optional[str] = None) -> None:
        self.device = device or DeviceConfig()
        self.mode = self.device.paged_attention
        self.platform = platform or gpu_platform() or "none"
        self._launch = launch
        self._ready: dict[bool, Optional[bool]] = {False: None if self.mode != "gather" else False, True: None}
        """Whether the kernels of float pools (False) / quantized pools (True) are used; None: not checked yet."""
        self._failures: dict[bool, Optional[str]] = {False: None, True: None}

    @property
    def failure(self) -> Optional[str]:
        """Why the float pools' kernels are not used (their first-use check's error), or None."""
        return self._failures[False]

    def __repr__(self) -> str:
        return f"GPUKernels(platform={self.platform!r}, paged_attention={self.mode!r})"

    def attention_path(self) -> str:
        """How this backend attends over paged KV, in words (what ``mlx-parallm doctor`` prints)."""
        if self.mode == "gather":
            return "gather (paged_attention='gather')"
        if self._ready[False] is None:
            return f"paged kernels ({self.platform}), checked at first use"
        if not self._ready[False]:
            return f"gather (the paged kernels failed their check: {self.failure})"
        if self._ready[True] is False:
            return f"paged kernels ({self.platform}); quantized KV gathered (its kernels failed their check: {self._failures[True]})"
        return f"paged kernels ({self.platform})"

    def kernels_ready(self, quantized: bool = False) -> bool:
        """Whether the paged kernels (of ``quantized`` pools) are used: compiled and checked
        once (see the module docstring); the quantized pools' need the float pools' too."""
        if quantized and not self.kernels_ready():
            return False
        if self._ready[quantized] is None:
            try:
                if self._launch is None:
                    self._launch = MLXKernels(self.platform)
                error = check_kernels(self._launch, quantized=quantized)
            except Exception as exc:  # a compile or launch failure: the kernels are not used
                error = f"{type(exc).__name__}: {exc}"
            what = "quantized-KV paged attention kernels" if quantized else "paged attention kernels"
            if error is not None and self.mode == "kernel":
                raise RuntimeError(f"the {what} failed their check: {error}")
            if error is not None:
                logger.warning("%s unusable on %s (%s): gathering paged KV instead", what, self.platform, error)
            self._ready[quantized], self._failures[quantized] = error is None, error
        return bool(self._ready[quantized])

    def paged_decode_attention(
        self, queries: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array, lengths: mx.array, block_size: int, scale: float,
        window: Optional[int] = None, scales: Optional[Sequence[mx.array]] = None, bits: int = 0,
        sinks: Optional[mx.array] = None, softcap: Optional[float] = None,
    ) -> Optional[mx.array]:
        """The kernels' attention (:func:`..paged_kernels.paged_attention`: attention ``sinks``,
        quantized pools' ``scales`` and ``bits``, a ``softcap`` included), or None (the caller
        gathers): layouts the kernels do not take, kernels not ready."""
        quantized = bool(bits) or scales is not None
        if not paged_kernels.takes(queries, k_pool, v_pool, lengths, scales, bits) or not self.kernels_ready(quantized):
            return None
        return paged_kernels.paged_attention(queries, k_pool, v_pool, table, lengths, block_size, scale, self._launch, window=window,
                                             sinks=sinks, scales=scales, bits=bits, softcap=softcap)

    def steps_attention(self, rope: Any) -> bool:
        return self.kernels_ready()  # (mlx-lm's RoPE modules all take per-row offsets)

    def fits_attention_step(self, heads: int, k_pool: mx.array, scales: Optional[Sequence[mx.array]], bits: int) -> bool:
        return not bits and scales is None and k_pool.dtype in paged_kernels.POOL_DTYPES and heads % k_pool.shape[1] == 0

    def paged_attention_step(self, queries: mx.array, keys: mx.array, values: mx.array, k_pool: mx.array, v_pool: mx.array,
                             slots: mx.array, table: mx.array, limits: mx.array, offset: mx.array, heads: int, rope: Any,
                             block_size: int, scale: float, scales: Optional[Sequence[mx.array]] = None) -> mx.array:
        """mlx-lm's attention from its projections on, with fewer ops: its layout changes
        (one position a row: reshapes alone), RoPE, the K/V writes by indexed assignment to
        the storage's pools, and the kernels' attention through the block tables."""
        B, L, _ = queries.shape
        kv_heads, D = k_pool.shape[1], k_pool.shape[2]
        q = rope(_by_head(queries, heads, D), offset=offset)
        k = rope(_by_head(keys, kv_heads, D), offset=offset)
        k_pool[slots] = (k.reshape(B, kv_heads, D) if L == 1 else k.swapaxes(1, 2).reshape(B * L, kv_heads, D)).astype(k_pool.dtype)
        v_pool[slots] = values.reshape(B * L, kv_heads, D).astype(v_pool.dtype)
        out = self.paged_decode_attention(q, k_pool, v_pool, table, limits, block_size, scale)
        if out is None:  # (steps_attention and fits_attention_step said the kernels take it)
            raise RuntimeError("the paged kernels did not take a step they were asked to")
        return out.reshape(B, L, heads * D) if L == 1 else out.swapaxes(1, 2).reshape(B, L, heads * D)


def _by_head(x: mx.array, heads: int, D: int) -> mx.array:
    """A projection ``(B, L, heads * D)`` as ``(B, heads, L, D)``."""
    B, L, _ = x.shape
    return x.reshape(B, heads, 1, D) if L == 1 else x.reshape(B, L, heads, D).swapaxes(1, 2)


def check_kernels(launch: Launch, seed: int = 0, quantized: bool = False) -> Optional[str]:
    """Attend a small random pool (GQA, shuffled blocks, a window, a prefill piece, attention
    sinks, a softcap, then float16 and bfloat16 queries and pools as a 16-bit model gives them;
    ``quantized``: as int8 and int4 blocks instead) by the kernels through ``launch`` and by the
    gather path; None where they agree, else what differs."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    heads, kv_heads, D, block = 4, 2, 32, 4
    B, L = 3, 2
    pool_slots = 24 * block
    k_pool = mx.random.normal((pool_slots, kv_heads, D), key=k1)
    v_pool = mx.random.normal((pool_slots, kv_heads, D), key=k2)
    queries = mx.random.normal((B, heads, L, D), key=k3)
    table = mx.array([[7, 2, 19, 4, 11], [3, 0, 0, 0, 0], [23, 9, 15, 1, 0]], dtype=mx.int32)
    limits = mx.array([[17, 18], [2, 3], [13, 15]], dtype=mx.int32)
    f32 = mx.float32
    cases = [(None, None, 0, None, f32), (5, None, 0, None, f32), (5, mx.array([0.5, -1.0, 2.0, 0.0]), 0, None, f32), (None, None, 0, 1.5, f32),
             (None, None, 0, None, mx.float16), (None, None, 0, None, mx.bfloat16)]  # (each dtype its own compiled kernels)
    if quantized:
        cases = [(None, None, bits, None, f32) for bits in paged_kernels.QUANTIZED_BITS] + [(5, None, 4, None, f32)]
    for window, sinks, bits, softcap, dtype in cases:
        q, k, v = (a.astype(dtype) for a in (queries, k_pool, v_pool))
        k, v, scales = paged_kernels.quantize_pools(k, v, bits) if bits else (k, v, None)
        args = (q, k, v, table, limits, block, 0.2)
        extra = {"window": window, "sinks": sinks, "scales": scales, "bits": bits, "softcap": softcap}
        got = paged_kernels.paged_attention(*args, launch, **extra).astype(f32)
        want = paged_kernels.gathered_attention(*args, **extra, exact=True).astype(f32)  # (not TF32, as a matmul would be on the GPU)
        diff = mx.abs(got - want)
        limit = CHECK_TOLERANCE if dtype == f32 else CHECK_TOLERANCE_16BIT * (1 + mx.abs(want))
        if not mx.all(diff <= limit).item():  # (NaN too)
            return (f"differs from the gather path by {diff.max().item():.3g} (window={window}, sinks={sinks is not None}, bits={bits or None}, "
                    f"softcap={softcap}, {dtype} queries and pools)")
    return None
