"""The CPU formulations of exp, softmax, attention and SwiGLU agree with MLX's own ops, are
chosen on the CPU for large tensors only, and work where no C++ compiler is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from mlx_parallm_provider.models import attention, backends, cpu_ops


def sdpa(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)


def rand(*shape, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed))


def test_fast_exp_matches_exp_to_float32_precision():
    x = mx.concatenate([mx.linspace(-87, 88, 20001), rand(1000) * 10])
    expected = mx.exp(x)
    rel = mx.abs(cpu_ops.fast_exp(x) - expected) / expected
    assert rel.max().item() < 1e-6


def test_fast_exp_is_exactly_zero_far_below_range_and_finite_far_above():
    got = cpu_ops.fast_exp(mx.array([-1e30, -1000.0, 1000.0, 1e30])).tolist()
    assert got[:2] == [0.0, 0.0]
    assert all(v > 1e38 and v < float("inf") for v in got[2:])


def test_softmax_matches_mlx_and_masked_entries_get_zero_weight():
    s = rand(4, 3, 3, 50) * 6
    s = mx.concatenate([s[..., :40], mx.full((4, 3, 3, 10), -1e30)], axis=-1)
    got = cpu_ops.softmax(s)
    assert mx.allclose(got, mx.softmax(s, axis=-1, precise=True), atol=1e-6).item()
    assert mx.all(got[..., 40:] == 0).item()


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("L,S,kind", [(1, 100, "bool"), (7, 100, "bool"), (9, 9, "causal"), (1, 50, None), (1, 30, "causal"), (5, 12, "additive")])
def test_attention_matches_mlx_sdpa(heads, kv_heads, L, S, kind):
    B = 3
    q, k, v = rand(B, heads, L, 64, seed=1), rand(B, kv_heads, S, 64, seed=2), rand(B, kv_heads, S, 64, seed=3)
    mask = kind
    if kind in ("bool", "additive"):  # left padding of 0, 3 and 6 tokens, as BatchKVCache makes
        mask = create_causal_mask(L, offset=S - L, left_padding=mx.array([0, 3, 6]))
        if kind == "additive":
            mask = mx.where(mask, 0.0, -mx.inf)
    got = cpu_ops.attention(q, k, v, 0.125, mask)
    assert got.shape == (B, heads, L, 64)
    assert mx.allclose(got, sdpa(q, k, v, mask), atol=2e-6).item()


def test_attention_with_a_per_head_mask():
    q, k, v = rand(2, 6, 4, 32, seed=1), rand(2, 2, 10, 32, seed=2), rand(2, 2, 10, 32, seed=3)
    mask = rand(2, 6, 4, 10, seed=4) > 0
    mask = mask | (mx.arange(10) == 9)  # every row keeps at least one key
    assert mx.allclose(cpu_ops.attention(q, k, v, 0.125, mask), sdpa(q, k, v, mask), atol=2e-6).item()


def test_swiglu_matches_mlx_lm():
    gate, x = rand(8, 1, 1536, seed=5) * 8, rand(8, 1, 1536, seed=6)
    assert mx.allclose(cpu_ops.swiglu(gate, x), attention.mlx_lm_swiglu(gate, x), atol=1e-5, rtol=1e-5).item()


def test_cpu_ops_chosen_on_cpu_for_large_tensors_only(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_ops, "attention", lambda *a: calls.append("attention") or sdpa(*a[:3], a[4]))
    # two query positions: one (decoding) goes to the extension's kernel, tests/unit/test_decode_attention.py
    small = (rand(1, 9, 2, 64), rand(1, 3, 16, 64), rand(1, 3, 16, 64))
    large = (rand(64, 9, 2, 64), rand(64, 3, 128, 64), rand(64, 3, 128, 64))
    kernels = backends.CPUKernels()
    kernels.dense_attention(*small, scale=0.125, mask=None)
    assert calls == []
    kernels.dense_attention(*large, scale=0.125, mask=None)
    assert calls == ["attention"]
    backends.MLXOps().dense_attention(*large, scale=0.125, mask=None)
    assert calls == ["attention"]


def test_cpu_ops_default_follows_env_then_device(monkeypatch):
    monkeypatch.setenv(backends.CPU_OPS_ENV, "0")
    assert backends.wants_kernels() is False
    monkeypatch.setenv(backends.CPU_OPS_ENV, "1")
    assert backends.wants_kernels() is True
    monkeypatch.delenv(backends.CPU_OPS_ENV)
    assert backends.wants_kernels() == (mx.default_device().type == mx.DeviceType.cpu)


def test_loaded_model_swiglu_is_routed(tiny_model):
    model = tiny_model.model
    module = sys.modules[type(model).__module__]
    if hasattr(module, "swiglu"):
        assert module.swiglu is attention.mlx_lm_swiglu  # mlx-lm's module untouched
        assert type(model.layers[0].mlp).__call__.__globals__["swiglu"] == backends.of(model).swiglu


def test_model_output_and_greedy_tokens_unchanged_by_cpu_ops(tiny_model, monkeypatch):
    """Every attention and SwiGLU of a tiny model through cpu_ops: same logits, same tokens."""
    from mlx_lm.models.cache import BatchKVCache

    model = tiny_model.model
    own = backends.of(model)
    monkeypatch.setattr(cpu_ops, "MIN_ELEMENTS", 0)
    prompts = mx.array([[5, 6, 7, 8, 9, 10], [1, 1, 1, 11, 12, 13]])

    def greedy(on):
        backends.install(model, own if on else backends.MLXOps())
        cache = [BatchKVCache([0, 3]) for _ in model.layers]
        logits = model(prompts, cache=cache)[:, -1, :]
        first = logits
        tokens = []
        for _ in range(6):
            token = mx.argmax(logits, axis=-1)
            tokens.append(token.tolist())
            logits = model(token[:, None], cache=cache)[:, -1, :]
        return first, tokens

    try:
        plain_logits, plain_tokens = greedy(False)
        fast_logits, fast_tokens = greedy(True)
    finally:
        backends.install(model, own)
    assert mx.allclose(plain_logits, fast_logits, atol=1e-4).item()
    assert fast_tokens == plain_tokens


NO_COMPILER_SCRIPT = """
import mlx_parallm_provider, mlx.core as mx
from mlx_parallm_provider.models import cpu_ops
x = mx.linspace(-20, 20, 1001)
assert mx.allclose(cpu_ops.fast_exp(x), mx.exp(x), rtol=1e-6).item()
q, k, v = (mx.random.normal(s) for s in [(4, 9, 1, 64), (4, 3, 40, 64), (4, 3, 40, 64)])
want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
assert mx.allclose(cpu_ops.attention(q, k, v, 0.125, None), want, atol=2e-6).item()
print("ok")
"""


def test_cpu_ops_work_without_a_cpp_compiler(tmp_path):
    """mx.compile JIT-builds fused CPU kernels with g++; with none on PATH, the same ops run
    unfused and give the same results."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sh").symlink_to(shutil.which("sh") or "/bin/sh")
    env = dict(os.environ, PATH=str(bin_dir))
    out = subprocess.run([sys.executable, "-c", NO_COMPILER_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
