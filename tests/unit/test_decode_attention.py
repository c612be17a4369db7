"""One-token attention as the MLX extension's CPU kernel (models/kernels/decode_attention.cpp,
models/attention.decode_attention): equal to mx.fast's attention for the masks and strides
the engine's caches produce, and routed only where it applies."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import pytest

import early
from early import Command
from mlx_parallm_provider.models import attention, backends, qmatmul_ext
from mlx_parallm_provider.models.backends import CPUKernels, MLXOps


def _extension():
    ext = qmatmul_ext.load()
    if ext is None:
        pytest.skip("the MLX extension does not build here (no C++ compiler or nanobind)")
    return ext


def rand(*shape: int, seed: int = 0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def sdpa(q, k, v, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)


def _left_padding_mask(batch: int, keys: int, seed: int) -> mx.array:
    """Each row attends from its own first key on, as a left-padded batch cache's mask."""
    pad = mx.random.randint(0, keys, (batch,), key=mx.random.key(seed))
    return (mx.arange(keys)[None] >= pad[:, None]).reshape(batch, 1, 1, keys)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (10, 2)])  # (10, 2): a group size without its own instance
@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("keys", [1, 17, 130])  # 130: over two blocks of 64 keys
def test_equals_mx_fast_without_a_mask(heads: int, kv_heads: int, dim: int, keys: int) -> None:
    ext = _extension()
    q, k, v = rand(3, heads, 1, dim, seed=1), rand(3, kv_heads, keys, dim, seed=2), rand(3, kv_heads, keys, dim, seed=3)
    got = ext.decode_attention(q, k, v, dim**-0.5)
    assert got.shape == q.shape and got.dtype == mx.float32
    assert mx.allclose(got, sdpa(q, k, v), atol=2e-6).item()


@pytest.mark.parametrize("kind", ["bool", "additive", "shared"])
def test_equals_mx_fast_with_a_mask(kind: str) -> None:
    ext = _extension()
    B, S = 5, 70
    q, k, v = rand(B, 9, 1, 64, seed=4), rand(B, 3, S, 64, seed=5), rand(B, 3, S, 64, seed=6)
    mask = _left_padding_mask(B, S, seed=7) if kind != "shared" else (mx.arange(S) % 3 != 1).reshape(1, 1, 1, S)
    if kind == "additive":
        mask = mx.where(mask, 0.0, -mx.inf)
    got = ext.decode_attention(q, k, v, 0.125, mask.reshape(mask.shape[0], S))
    assert mx.allclose(got, sdpa(q, k, v, mask), atol=2e-6).item()


def test_reads_keys_through_their_strides() -> None:
    """Keys and values as a batch cache returns them: a slice of a longer buffer; and a
    transposed last axis (copied by the kernel)."""
    ext = _extension()
    buffer_k, buffer_v = rand(4, 2, 96, 32, seed=8), rand(4, 2, 96, 32, seed=9)
    k, v = buffer_k[..., 5:45, :], buffer_v[..., 5:45, :]
    q = rand(4, 6, 1, 32, seed=10)
    assert mx.allclose(ext.decode_attention(q, k, v, 32**-0.5), sdpa(q, k, v), atol=2e-6).item()
    kt = rand(4, 2, 32, 40, seed=11).swapaxes(-1, -2)  # last axis strided
    assert mx.allclose(ext.decode_attention(q, kt, v, 32**-0.5), sdpa(q, kt, v), atol=2e-6).item()


def test_threads_give_the_same_bits() -> None:
    ext = _extension()
    q, k, v = rand(64, 9, 1, 64, seed=20), rand(64, 3, 50, 64, seed=21), rand(64, 3, 50, 64, seed=22)
    one = ext.decode_attention(q, k, v, 0.125, threads=1)
    assert mx.array_equal(one, ext.decode_attention(q, k, v, 0.125, threads=3)).item()


def test_rejects_what_it_does_not_compute() -> None:
    ext = _extension()
    q, k = rand(2, 4, 1, 24), rand(2, 2, 8, 24)
    with pytest.raises(ValueError, match="head dim"):
        ext.decode_attention(q, k, k, 0.2)  # 24 is not a multiple of 16
    with pytest.raises(ValueError, match="one query"):
        ext.decode_attention(rand(2, 4, 2, 32), rand(2, 2, 8, 32), rand(2, 2, 8, 32), 0.2)
    with pytest.raises(ValueError, match="mask"):
        ext.decode_attention(rand(2, 4, 1, 32), rand(2, 2, 8, 32), rand(2, 2, 8, 32), 0.2, mx.ones((3, 8), dtype=mx.bool_))


def test_dense_attention_routes_decoding_to_the_kernel(monkeypatch) -> None:
    _extension()
    calls = []
    real = attention._extension

    class Spy:
        def __getattr__(self, name):
            return getattr(real(), name)

        def decode_attention(self, *args):
            calls.append(args[4] is None)
            return real().decode_attention(*args)

    monkeypatch.setattr(attention, "_extension", Spy)
    q, k, v = rand(2, 9, 1, 64), rand(2, 3, 12, 64), rand(2, 3, 12, 64)
    per_head = mx.ones((2, 9, 1, 12), dtype=mx.bool_)
    kernels = CPUKernels()
    assert mx.allclose(kernels.dense_attention(q, k, v, 0.125, "causal"), sdpa(q, k, v), atol=2e-6).item()
    kernels.dense_attention(q, k, v, 0.125, _left_padding_mask(2, 12, seed=23))
    assert calls == [True, False]
    kernels.dense_attention(q, k, v, 0.125, per_head)  # a mask per head: MLX's ops
    kernels.dense_attention(rand(2, 9, 3, 64), k, v, 0.125, None)  # three positions: MLX's ops
    MLXOps().dense_attention(q, k, v, 0.125, None)  # MLX's ops as the backend: never the kernel
    assert calls == [True, False]


def test_without_the_extension_decoding_uses_mlx_ops(monkeypatch) -> None:
    monkeypatch.setattr(attention, "_extension", lambda: None)
    q, k, v = rand(3, 9, 1, 64), rand(3, 3, 20, 64), rand(3, 3, 20, 64)
    mask = _left_padding_mask(3, 20, seed=24)
    assert attention.decode_attention(q, k, v, 0.125, mask) is None
    assert mx.allclose(CPUKernels().dense_attention(q, k, v, 0.125, mask), sdpa(q, k, v, mask), atol=2e-6).item()


def test_paged_kernel_matches_attention_over_each_rows_gathered_blocks():
    """The paged decode kernel reads rows through block tables (runs of consecutive blocks
    as one segment, a last block partly filled) as plain attention over the gathered keys."""
    import mlx.core as mx

    from mlx_parallm_provider.models import attention

    if not backends.wants_kernels():
        pytest.skip("CPU ops are off on this device")
    mx.random.seed(3)
    bs, kv_heads, heads, D = 4, 2, 6, 32
    k_pool, v_pool = mx.random.normal((40 * bs, kv_heads, D)), mx.random.normal((40 * bs, kv_heads, D))
    tables = [[5, 6, 7, 2], [9], [3, 4, 30, 31, 32], [11, 12]]
    lengths = [15, 1, 18, 5]
    q = mx.random.normal((len(tables), heads, 1, D))
    width = max(map(len, tables))
    table = mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)
    out = attention.paged_decode_attention(q, k_pool, v_pool, table, mx.array(lengths, dtype=mx.int32), bs, 0.125)
    if out is None:
        pytest.skip("no MLX extension here (no compiler)")
    for b, (t, n) in enumerate(zip(tables, lengths)):
        slots = mx.array([t[i // bs] * bs + i % bs for i in range(n)])
        k, v = k_pool[slots].swapaxes(0, 1)[None], v_pool[slots].swapaxes(0, 1)[None]
        expected = mx.fast.scaled_dot_product_attention(q[b : b + 1], k, v, scale=0.125)
        assert mx.allclose(out[b : b + 1], expected, atol=1e-5).item(), b


def _float16_pools_case():
    """Pools of float16 values (a subnormal, -0 and a large value among them), a block table
    and the float32 pools of the same values."""
    mx.random.seed(1)
    bs, kv_heads, heads, D = 16, 3, 9, 64
    k = (mx.random.normal((50 * bs, kv_heads, D)) * 3).astype(mx.float16)
    v = (mx.random.normal((50 * bs, kv_heads, D)) * 3).astype(mx.float16)
    specials = mx.array([[[6e-8] * D] * kv_heads, [[-0.0] * D] * kv_heads, [[60000.0 / 1000] * D] * kv_heads], dtype=mx.float16)
    k = mx.concatenate([specials, k[3:]])
    table, lengths = mx.array([[3, 7, 9, 1], [0, 2, 4, 6]], dtype=mx.int32), mx.array([60, 33], dtype=mx.int32)
    return mx.random.normal((2, heads, 1, D)), k, v, table, lengths, bs


def test_paged_kernel_reads_float16_pools_as_the_float32_values_they_hold():
    _extension()
    q, k, v, table, lengths, bs = _float16_pools_case()
    half = CPUKernels(attention_threads=2).paged_decode_attention(q, k, v, table, lengths, bs, 0.125)
    assert half is not None and half.dtype == mx.float32  # the kernel, not the gathered fallback
    wide = attention.paged_decode_attention(q, k.astype(mx.float32), v.astype(mx.float32), table, lengths, bs, 0.125)
    assert mx.array_equal(half, wide).item()  # widening is exact: the same sums


_FORCED_BUILD = """
import os, sys
import mlx_parallm_provider.models  # (the BLAS before mlx)
import mlx.core as mx
from mlx_parallm_provider.models import qmatmul, qmatmul_ext
if sys.argv[1] == "portable":
    qmatmul.native_flags = lambda compiler: []
else:
    os.environ[qmatmul.MARCH_ENV] = sys.argv[1]
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]  # the test module and the tests' helpers
from test_decode_attention import _float16_pools_case
from test_decode_attention import _left_padding_mask, rand, sdpa
ext = qmatmul_ext.load()
q, k, v, table, lengths, bs = _float16_pools_case()
half = ext.paged_decode_attention(q, k, v, table, lengths, bs, 0.125, 1)
wide = ext.paged_decode_attention(q, k.astype(mx.float32), v.astype(mx.float32), table, lengths, bs, 0.125, 1)
print("EQUAL" if mx.array_equal(half, wide).item() else "DIFFERENT")
wrong = []
for heads, kv_heads, dim, keys in [(9, 3, 64, 130), (10, 2, 16, 17), (8, 1, 128, 70), (4, 4, 64, 1), (16, 1, 32, 9)]:
    q, k, v = rand(3, heads, 1, dim, seed=1), rand(3, kv_heads, keys, dim, seed=2), rand(3, kv_heads, keys, dim, seed=3)
    mask = _left_padding_mask(3, keys, seed=7)
    for m, expected in [(None, sdpa(q, k, v)), (mask.reshape(3, keys), sdpa(q, k, v, mask)),
                        (mx.where(mask, 0.0, -mx.inf).reshape(3, keys), sdpa(q, k, v, mask))]:
        if not mx.allclose(ext.decode_attention(q, k, v, dim**-0.5, m, threads=2), expected, atol=2e-6).item():
            wrong.append((heads, kv_heads, dim, keys, m is not None))
q, k, v, table, lengths, bs = _float16_pools_case()
k, v = k.astype(mx.float32), v.astype(mx.float32)
q = rand(2, 9, 3, 64, seed=4)  # 3 query positions a row (a verify step), each seeing its own number of tokens
limits = [[20, 33, 60], [1, 17, 33]]
several = ext.paged_decode_attention(q, k, v, table, mx.array(limits, dtype=mx.int32), bs, 0.125, 2)
for b in range(2):
    for j, n in enumerate(limits[b]):
        slots = mx.array([table[b, i // bs].item() * bs + i % bs for i in range(n)])
        expected = sdpa(q[b : b + 1, :, j : j + 1], k[slots].swapaxes(0, 1)[None], v[slots].swapaxes(0, 1)[None])
        if not mx.allclose(several[b : b + 1, :, j : j + 1], expected, atol=1e-5).item():
            wrong.append(("paged", b, j))
windowed = ext.paged_decode_attention(q, k, v, table, mx.array(limits, dtype=mx.int32), bs, 0.125, 2, 12)  # a sliding window
for b in range(2):
    for j, n in enumerate(limits[b]):
        slots = mx.array([table[b, i // bs].item() * bs + i % bs for i in range(max(0, n - 12), n)])
        expected = sdpa(q[b : b + 1, :, j : j + 1], k[slots].swapaxes(0, 1)[None], v[slots].swapaxes(0, 1)[None])
        if not mx.allclose(windowed[b : b + 1, :, j : j + 1], expected, atol=1e-5).item():
            wrong.append(("windowed", b, j))
for bits in (8, 4):  # quantized pools (the scalar dequantization where the build has no AVX-512)
    codes = [mx.quantize(x.astype(mx.float16), group_size=32, bits=bits) for x in (k, v)]
    scales = [codes[0][1], codes[0][2], codes[1][1], codes[1][2]]
    coded = ext.paged_decode_attention(q, codes[0][0], codes[1][0], table, mx.array(limits, dtype=mx.int32), bs, 0.125, 2, 12,
                                       scales, bits)
    wk, wv = (mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits) for w, s, b in codes)
    wide = ext.paged_decode_attention(q, wk, wv, table, mx.array(limits, dtype=mx.int32), bs, 0.125, 2, 12)
    if not mx.allclose(coded, wide, atol=2e-5).item():
        wrong.append(("quantized", bits))
print("MATCHES" if not wrong else f"WRONG {wrong}")
"""


@functools.cache
def _forced_build_skipped(march: str) -> Optional[str]:
    """Why this machine skips the forced ``march`` build, or None (asked at collection and
    by the test: the compiler probes run once)."""
    from mlx_parallm_provider.models import qmatmul

    if march == "portable":
        return None
    if not ({"avx2", "fma", "f16c"} <= qmatmul.cpu_flags() and qmatmul.march_problem("cc", march) is None):
        return "not an x86 CPU with AVX2, FMA and F16C"
    if qmatmul.isa_macros("cc", qmatmul.native_flags("cc")) == qmatmul.isa_macros("cc", [f"-march={march}"]):
        return f"this CPU's own build takes the {march} paths (the same vector-feature macros): the tests above ran that code"
    return None


def _forced_build(params: dict) -> Optional[Command]:
    """The child that builds the extension for ``params["march"]`` in a kernel home of its own and checks it."""
    import os
    import sys
    from pathlib import Path

    march = params["march"]
    if _forced_build_skipped(march) is not None:
        return None
    home = early.scratch(f"forced-{march}")
    env = dict(os.environ, MLX_PARALLM_HOME=str(home))
    return Command([sys.executable, "-c", _FORCED_BUILD, march, str(Path(__file__).parent)], env=env)


@pytest.mark.early(command=_forced_build)
@pytest.mark.parametrize("march", ["x86-64-v3", "portable"])
def test_forced_builds_widen_float16_pools_alike(march: str, request: pytest.FixtureRequest) -> None:
    """The F16C path (``x86-64-v3``, which an AVX-512 build never runs) and the portable one
    (no ``-march``: a scalar conversion), each built in a child process of its own: float16
    pools read as the float32 values they hold, and the decode kernel equal to mx.fast's
    attention (with and without masks, several head groups and dimensions; paged, several
    positions a row, with and without a sliding window; quantized pools as the float32 values they hold).
    A CPU whose own build is the x86-64-v3 path's (AVX2 without AVX-512) skips that build: the
    tests above ran that code. (The children start early, beside the other tests.)"""
    _extension()
    if (why := _forced_build_skipped(march)) is not None:
        pytest.skip(why)
    out = early.result(request)
    assert out.stdout.strip().splitlines()[-2:] == ["EQUAL", "MATCHES"], out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.parametrize("kv_heads, heads, L", [(3, 9, 5), (2, 6, 4), (1, 16, 3), (4, 4, 13)])  # 15, 12, 48 or 13 query rows a head
def test_paged_kernel_attends_several_positions_a_row_each_as_alone(kv_heads: int, heads: int, L: int):
    """A verify step's positions: position j sees limits[b][j] tokens, and computes what a
    one-position call with that length computes (a row's blocks read once for all of them);
    padding (a row's last limit repeated) is not attended: it gets its row's last output."""
    _extension()
    mx.random.seed(5)
    bs, D = 4, 32
    k_pool, v_pool = mx.random.normal((60 * bs, kv_heads, D)), mx.random.normal((60 * bs, kv_heads, D))
    tables = [[5, 6, 7, 2, 40, 41, 42, 43], [9, 10, 11, 12, 13], [3, 4, 30, 31, 32, 33, 34, 35]]
    starts, news = [15, 2, 18], [L, 1, L - 1]  # the second row verifies nothing: padding past its token
    width = max(map(len, tables))
    table = mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)
    limits = mx.array([[s + min(j, n - 1) + 1 for j in range(L)] for s, n in zip(starts, news)], dtype=mx.int32)
    q = mx.random.normal((3, heads, L, D))
    out = attention.paged_decode_attention(q, k_pool, v_pool, table, limits, bs, 0.125)
    assert out is not None and out.shape == q.shape
    for b, (s, n) in enumerate(zip(starts, news)):
        for j in range(n):
            one = attention.paged_decode_attention(q[b : b + 1, :, j : j + 1], k_pool, v_pool, table[b : b + 1],
                                                   mx.array([s + j + 1], dtype=mx.int32), bs, 0.125)
            assert mx.array_equal(out[b : b + 1, :, j : j + 1], one).item(), (b, j)
            slots = mx.array([tables[b][i // bs] * bs + i % bs for i in range(s + j + 1)])
            k, v = k_pool[slots].swapaxes(0, 1)[None], v_pool[slots].swapaxes(0, 1)[None]
            expected = mx.fast.scaled_dot_product_attention(q[b : b + 1, :, j : j + 1], k, v, scale=0.125)
            assert mx.allclose(out[b : b + 1, :, j : j + 1], expected, atol=1e-5).item(), (b, j)
        for j in range(n, L):
            assert mx.array_equal(out[b, :, j], out[b, :, n - 1]).item(), (b, j)


@pytest.mark.parametrize("rows, context, L", [(8, 300, 1), (3, 700, 4), (40, 40, 1), (1, 1256, 12), (1, 300, 2), (1, 500, 7), (1, 1256, 1)])
def test_paged_kernel_on_several_threads_computes_what_one_does(rows: int, context: int, L: int):
    """Rows shared out to the packed-weight kernel's pool (as many key positions as these
    take two threads) give the same sums, bit for bit, as one thread, call after call; so do
    one row's positions, which two threads take in other passes than one thread does, and
    one row's one position, whose KV heads two threads share out."""
    _extension()
    mx.random.seed(9)
    bs, kv_heads, heads, D = 16, 3, 9, 64
    blocks = -(-context // bs)
    k_pool = mx.random.normal(((rows * blocks + 1) * bs, kv_heads, D))
    v_pool = mx.random.normal(((rows * blocks + 1) * bs, kv_heads, D))
    table = mx.array([[1 + b * blocks + i for i in range(blocks)] for b in range(rows)], dtype=mx.int32)
    limits = mx.array([[context - b % 5 - (L - 1) + j for j in range(L)] for b in range(rows)], dtype=mx.int32)
    q = mx.random.normal((rows, heads, L, D))
    if L == 1:
        limits = limits[:, 0]
    one = CPUKernels(attention_threads=1).paged_decode_attention(q, k_pool, v_pool, table, limits, bs, 0.125)
    for _ in range(3):
        two = CPUKernels(attention_threads=2).paged_decode_attention(q, k_pool, v_pool, table, limits, bs, 0.125)
        assert mx.array_equal(one, two).item()


@pytest.mark.parametrize("window, threads", [(8, 1), (8, 2), (70, 1), (70, 2), (200, 2)])
def test_paged_kernel_with_a_window_attends_each_positions_last_tokens_as_alone(window: int, threads: int):
    """A sliding-window layer's pass (a prefill piece of 40 positions a row, whose windows
    start in different 64-position tiles): position j sees only the last ``window`` of its
    tokens, each computed as a one-position call computes it, and as attention over exactly
    those tokens gathered does; the blocks wholly before every window may be the null block
    (released), never read."""
    _extension()
    mx.random.seed(11)
    bs, kv_heads, heads, D, L = 4, 3, 9, 32, 40
    k_pool, v_pool = mx.random.normal((130 * bs, kv_heads, D)), mx.random.normal((130 * bs, kv_heads, D))
    starts = [50, 0, 130]  # tokens held before the piece
    tables = [list(range(1 + 40 * b, 1 + 40 * b + -(-(s + L) // bs))) for b, s in enumerate(starts)]
    first_needed = [max(0, s + 1 - window) // bs for s in starts]  # blocks before every window of the row: released
    tables = [[0 if i < f else blk for i, blk in enumerate(t)] for t, f in zip(tables, first_needed)]
    width = max(map(len, tables))
    table = mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)
    limits = mx.array([[s + j + 1 for j in range(L)] for s in starts], dtype=mx.int32)
    q = mx.random.normal((3, heads, L, D))
    kernels = CPUKernels(attention_threads=threads)
    out = kernels.paged_decode_attention(q, k_pool, v_pool, table, limits, bs, 0.125, window=window)
    assert out is not None and out.shape == q.shape
    for b, s in enumerate(starts):
        for j in range(L):
            one = kernels.paged_decode_attention(q[b : b + 1, :, j : j + 1], k_pool, v_pool, table[b : b + 1],
                                                 mx.array([s + j + 1], dtype=mx.int32), bs, 0.125, window=window)
            assert mx.array_equal(out[b : b + 1, :, j : j + 1], one).item(), (b, j)
            seen = range(max(0, s + j + 1 - window), s + j + 1)
            slots = mx.array([tables[b][i // bs] * bs + i % bs for i in seen])
            k, v = k_pool[slots].swapaxes(0, 1)[None], v_pool[slots].swapaxes(0, 1)[None]
            expected = mx.fast.scaled_dot_product_attention(q[b : b + 1, :, j : j + 1], k, v, scale=0.125)
            assert mx.allclose(out[b : b + 1, :, j : j + 1], expected, atol=1e-5).item(), (b, j)
    assert MLXOps().paged_decode_attention(q, k_pool, v_pool, table, limits, bs, 0.125, window=window) is None
