"""RMSNorm and RoPE as fused CPU ops (models/fused_ops.py,
models/kernels/norm_rope.cpp): equal to mx.fast's, and routed only where they apply."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_parallm_provider.models import attention, backend, backends, fused_ops, qmatmul_ext
from mlx_parallm_provider.models.backends import CPUKernels, MLXOps


def _extension():
    ext = qmatmul_ext.load()
    if ext is None:
        pytest.skip("the MLX extension does not build here (no C++ compiler or nanobind)")
    return ext


def _close(got: mx.array, expected: mx.array) -> bool:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    return np.allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (2, 3, 64), (5, 40), (3,)])
@pytest.mark.parametrize("weight_dtype", [mx.float32, mx.float16])
def test_rms_norm_equals_mx_fast(shape: tuple[int, ...], weight_dtype) -> None:
    ext = _extension()
    x = mx.random.normal(shape, key=mx.random.key(0)) * 3.0
    w = mx.random.normal(shape[-1:], key=mx.random.key(1)).astype(weight_dtype)
    for eps in (1e-5, 1e-6):
        assert _close(ext.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps))


def test_rms_norm_reads_strided_lazy_inputs() -> None:
    ext = _extension()
    x = mx.random.normal((64, 4), key=mx.random.key(2)).T[:, None, :] + 1.0  # (4, 1, 64), column-major
    w = mx.random.normal((64,), key=mx.random.key(3))
    assert _close(ext.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5))


def _queries(batch: int, length: int, heads: int, head_dim: int, seed: int = 0) -> mx.array:
    # As attention lays them out: (B, L, H, D) projected, then transposed to (B, H, L, D).
    return mx.random.normal((batch, length, heads, head_dim), key=mx.random.key(seed)).transpose(0, 2, 1, 3)


OFFSETS = {
    "int 0": lambda b: 0,
    "int 1000": lambda b: 1000,
    "per-row array": lambda b: mx.array([3 + 517 * i for i in range(b)]),
    "one-element array": lambda b: mx.array([77]),
    "0-d array": lambda b: mx.array(4095),
    "int64 array": lambda b: mx.array([9] * b, dtype=mx.int64),
}


@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("head_dim,dims", [(64, 64), (64, 32), (80, 48)])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", list(OFFSETS))
def test_rope_equals_mx_fast(batch: int, length: int, head_dim: int, dims: int, traditional: bool, offset: str) -> None:
    ext = _extension()
    x = _queries(batch, length, 3, head_dim)
    off = OFFSETS[offset](batch)
    for base, scale in ((10000.0, 1.0), (500000.0, 0.25)):
        expected = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=off)
        rope = fused_ops.FusedRoPE(nn.RoPE(dims, traditional=traditional, base=base, scale=scale), ext)
        as_array = off if isinstance(off, mx.array) else mx.array(off, dtype=mx.int32)
        got = ext.rope(x, dims, traditional, scale, as_array, rope._freq)
        assert _close(got, expected), (base, scale)


@pytest.mark.parametrize("shape", [(2, 5, 64), (2, 3, 2, 4, 64)])
def test_rope_takes_3d_and_5d_inputs_as_mx_fast_does(shape: tuple[int, ...]) -> None:
    ext = _extension()
    x = mx.random.normal(shape, key=mx.random.key(4))
    rope = fused_ops.FusedRoPE(nn.RoPE(32), ext)
    offset = mx.array([11, 2000])
    assert _close(ext.rope(x, 32, False, 1.0, offset, rope._freq), mx.fast.rope(x, 32, traditional=False, base=10000, scale=1.0, offset=offset))


def test_rope_rejects_what_mx_fast_rejects() -> None:
    ext = _extension()
    freq = fused_ops._inv_freq(64, 10000.0)
    x = _queries(2, 1, 2, 64)
    with pytest.raises(ValueError, match="offset"):
        ext.rope(x, 64, False, 1.0, mx.array([1, 2, 3]), freq)
    with pytest.raises(ValueError, match="dims"):
        ext.rope(x, 63, False, 1.0, mx.array(0), fused_ops._inv_freq(62, 10000.0))  # odd
    with pytest.raises(ValueError):
        ext.rope(x.astype(mx.float16), 64, False, 1.0, mx.array(0), freq)


def _counting(ext, calls: list[str]):
    return SimpleNamespace(
        rms_norm=lambda *a: calls.append("rms_norm") or ext.rms_norm(*a),
        rope=lambda *a: calls.append("rope") or ext.rope(*a),
    )


def test_modules_use_the_fused_ops_for_float32_on_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    ext = _extension()
    calls: list[str] = []
    monkeypatch.setattr(attention, "_extension", lambda: _counting(ext, calls))
    source_norm, source_rope = nn.RMSNorm(64, eps=1e-6), nn.RoPE(64, base=50000.0, scale=0.5)
    source_norm.weight = mx.random.normal((64,), key=mx.random.key(5))
    norm, rope = fused_ops.FusedRMSNorm(source_norm, CPUKernels()), fused_ops.FusedRoPE(source_rope, CPUKernels())
    assert norm.weight is source_norm.weight and norm.eps == 1e-6 and (rope.dims, rope.base, rope.scale) == (64, 50000.0, 0.5)
    few, many = mx.random.normal((4, 1, 64)), mx.random.normal((64, 1, 64))
    assert _close(norm(few), source_norm(few)) and _close(norm(many), source_norm(many))
    assert calls == ["rms_norm", "rms_norm"]
    queries = _queries(64, 2, 3, 64)  # 64 rows of 2 positions
    assert _close(rope(queries, offset=mx.arange(64) + 5), source_rope(queries, offset=mx.arange(64) + 5))
    assert _close(rope(_queries(1, 5, 30, 64), offset=7), source_rope(_queries(1, 5, 30, 64), offset=7))  # a prefill
    assert calls == ["rms_norm", "rms_norm", "rope", "rope"]
    calls.clear()
    assert _close(norm(few.astype(mx.float16)), source_norm(few.astype(mx.float16)))  # not float32
    assert calls == []
    norm.backend = rope.backend = MLXOps()  # a model on MLX's own ops (MLX_PARALLM_CPU_OPS=0)
    assert _close(norm(few), source_norm(few)) and _close(rope(queries, offset=3), source_rope(queries, offset=3))
    assert calls == []


def test_install_replaces_norms_and_plain_rope_only(tiny_model_dir: Path) -> None:
    import mlx_lm
    from mlx_lm.models.rope_utils import initialize_rope

    _extension()
    model, _ = mlx_lm.load(str(tiny_model_dir))
    llama3 = initialize_rope(16, 10000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model.model.layers[0].self_attn.rope = llama3
    norms = sum(isinstance(m, nn.RMSNorm) for _, m in model.named_modules())
    ropes = sum(type(m) is nn.RoPE for _, m in model.named_modules())
    kernels = CPUKernels()
    assert fused_ops.install(model, kernels) == norms + ropes
    assert model.model.layers[0].self_attn.rope is llama3
    assert model.model.norm.backend is kernels
    assert type(model.model.layers[1].self_attn.rope) is fused_ops.FusedRoPE
    assert type(model.model.norm) is fused_ops.FusedRMSNorm
    assert dict(model.parameters().items()).keys() == dict(mlx_lm.load(str(tiny_model_dir))[0].parameters().items()).keys()


def test_prepared_model_gives_the_same_logits_with_and_without_fused_ops(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm

    _extension()
    monkeypatch.setenv("MLX_PARALLM_INT8_MATMUL", "0")  # the float kernels: only the fused ops differ from MLX's
    model, _ = mlx_lm.load(str(tiny_model_dir))
    nn.quantize(model, group_size=32, bits=4)
    backend.prepare_model(model, dequantize=True)
    assert any(isinstance(m, fused_ops.FusedRoPE) for _, m in model.named_modules())
    from mlx_lm.models.cache import make_prompt_cache

    def decode() -> list[mx.array]:  # one token a step: one row, offsets 0..3
        cache = make_prompt_cache(model)
        return [model(mx.array([[t]]), cache=cache) for t in (5, 6, 7, 8)]

    fused = decode()
    with backends.using(model, "mlx"):  # everything back on mx.fast and the GEMM
        plain = decode()
    for a, b in zip(fused, plain):
        assert np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_without_the_extension_nothing_changes(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm

    monkeypatch.setattr(qmatmul_ext, "load", lambda: None)
    model, _ = mlx_lm.load(str(tiny_model_dir))
    nn.quantize(model, group_size=32, bits=4)
    assert fused_ops.install(model, CPUKernels()) == 0
    backend.prepare_model(model, dequantize=True, kernels="cpu")
    assert not any(isinstance(m, (fused_ops.FusedRMSNorm, fused_ops.FusedRoPE)) for _, m in model.named_modules())
    assert type(model.model.norm) is nn.RMSNorm and type(model.model.layers[0].self_attn.rope) is nn.RoPE


@pytest.mark.parametrize("shape", [(1, 1, 1536), (64, 1, 1536), (3, 7, 5), (1,)])
def test_swiglu_equals_silu_gate_in_float64(shape: tuple[int, ...]) -> None:
    ext = _extension()
    gate = mx.random.normal(shape, key=mx.random.key(0)) * 6.0
    x = mx.random.normal(shape, key=mx.random.key(1))
    g, xv = np.asarray(gate, dtype=np.float64), np.asarray(x, dtype=np.float64)
    expected = g / (1.0 + np.exp(-g)) * xv
    got = ext.swiglu(gate, x)
    assert got.shape == gate.shape and got.dtype == mx.float32
    assert np.allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-7)


def test_swiglu_saturates_and_reads_strided_inputs() -> None:
    ext = _extension()
    gate = mx.array([[-1e4, -200.0, -88.0, 0.0, 88.0, 200.0, 1e4, float("inf")]])
    x = mx.full(gate.shape, 2.0)
    got = np.asarray(ext.swiglu(gate, x))[0]
    assert np.allclose(got[:6], [0.0, 0.0, 0.0, 0.0, 176.0, 400.0], atol=1e-30)  # silu(-large) -> 0, silu(large) -> gate
    assert got[6] == 2e4 and np.isnan(got[7]) or got[7] == float("inf")
    wide = mx.random.normal((6, 4), key=mx.random.key(2))
    gate_t, x_t = wide.T, (wide * 0.5).T  # transposed views: not row-contiguous
    assert _close(ext.swiglu(gate_t, x_t), nn.silu(gate_t) * x_t)
    fused = mx.random.normal((5, 1, 64), key=mx.random.key(3))  # a fused gate/up output, sliced in two
    gate_s, up_s = fused[..., :32], fused[..., 32:]
    assert _close(ext.swiglu(gate_s, up_s), nn.silu(gate_s) * up_s)
    with pytest.raises(ValueError, match="same shape"):
        ext.swiglu(gate, mx.zeros((2, 8)))


def test_cpu_kernels_route_swiglu_to_the_fused_op_at_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # One op for one row and for 64, so a row batched computes its gate as it would alone.
    ext = _extension()
    calls = []
    monkeypatch.setattr(backends.cpu_kernels, "_fused", lambda: SimpleNamespace(swiglu=lambda g, x: calls.append(g.shape) or ext.swiglu(g, x)))
    ops = CPUKernels()
    for rows in (1, 64):
        gate = mx.random.normal((rows, 1, 1536), key=mx.random.key(rows))
        assert _close(ops.swiglu(gate, gate), nn.silu(gate) * gate)
    assert calls == [(1, 1, 1536), (64, 1, 1536)]
    ops.swiglu(gate.astype(mx.float16), gate.astype(mx.float16))  # other dtypes keep MLX's ops
    assert len(calls) == 2
