"""The paged attention kernels against the gather path: one layer's decode attention over
long rows in shuffled blocks, timed, with the two paths' largest difference."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from ...models import paged_kernels
from .timing import timed


def paged_step_times(launch: paged_kernels.Launch, contexts: Sequence[int] = (1000, 4000), rows: Sequence[int] = (1, 8, 32),
                     heads: int = 32, kv_heads: int = 8, head_dim: int = 64, block_size: int = 16, dtype: mx.Dtype = mx.bfloat16,
                     repeats: int = 7, quantized_bits: int = 8) -> list[dict[str, Any]]:
    """One layer's decode attention over rows of ``contexts`` tokens in shuffled blocks: the
    kernels (``launch``) against the gather path, in ms, with their largest difference; also
    over the same pools quantized to ``quantized_bits`` (``kv_cache_dtype="int8"``'s blocks;
    0 or a head size not divisible by 32: not measured)."""
    out = []
    for context in contexts:
        for B in rows:
            per_row = -(-context // block_size)
            blocks = B * per_row + 1
            order = mx.random.permutation(blocks)[: B * per_row].reshape(B, per_row).astype(mx.int32)
            k_pool = mx.random.normal((blocks * block_size, kv_heads, head_dim)).astype(dtype)
            v_pool = mx.random.normal((blocks * block_size, kv_heads, head_dim)).astype(dtype)
            queries = mx.random.normal((B, heads, 1, head_dim)).astype(dtype)
            lengths = mx.full((B,), context, dtype=mx.int32)
            scale = head_dim**-0.5
            mx.eval(order, k_pool, v_pool, queries)

            def kernel():
                return paged_kernels.paged_attention(queries, k_pool, v_pool, order, lengths, block_size, scale, launch)

            def gather():
                return paged_kernels.gathered_attention(queries, k_pool, v_pool, order, lengths, block_size, scale)

            diff = mx.abs(kernel().astype(mx.float32) - gather().astype(mx.float32)).max().item()
            fns = {"kernel": kernel, "gather": gather}
            if quantized_bits and head_dim % paged_kernels.QUANTIZED_GROUP == 0:
                kc, vc, scales = paged_kernels.quantize_pools(k_pool, v_pool, quantized_bits)
                mx.eval(kc, vc, *scales)
                fns["kernel_q"] = lambda: paged_kernels.paged_attention(queries, kc, vc, order, lengths, block_size, scale, launch,
                                                                        scales=scales, bits=quantized_bits)
                fns["gather_q"] = lambda: paged_kernels.gathered_attention(queries, kc, vc, order, lengths, block_size, scale,
                                                                           scales=scales, bits=quantized_bits)
            ms = timed(fns, repeats)
            k_ms, g_ms = ms["kernel"], ms["gather"]
            row = {"context": context, "rows": B, "kernel_ms": k_ms, "gather_ms": g_ms, "gather_over_kernel": g_ms / k_ms, "max_diff": diff}
            if "kernel_q" in ms:
                q_diff = mx.abs(fns["kernel_q"]().astype(mx.float32) - fns["gather_q"]().astype(mx.float32)).max().item()
                row.update({f"int{quantized_bits}_kernel_ms": ms["kernel_q"], f"int{quantized_bits}_gather_ms": ms["gather_q"],
                            f"int{quantized_bits}_max_diff": q_diff})
            out.append(row)
    return out
