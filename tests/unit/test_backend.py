"""CPU backend choices: BLAS preload before mlx, dequantize-at-load on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlx_parallm_provider.models import backend

PROBE = (
    "import json, mlx_parallm_provider as p, mlx.core as mx\n"
    "from mlx_parallm_provider.models import backend as b\n"
    "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))\n"
    "print(json.dumps(b.blas_in_use()))\n"
)


def _blas_in_subprocess(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != backend.BLAS_ENV}
    if value is not None:
        env[backend.BLAS_ENV] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS preload is Linux-only")
def test_blas_env_switch() -> None:
    assert "reference BLAS" in _blas_in_subprocess("off")
    auto = _blas_in_subprocess(None)
    if backend.find_openblas() is None:
        assert "reference BLAS" in auto
    else:
        assert auto.startswith("OpenBLAS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS preload is Linux-only")
def test_blas_env_bad_path_falls_back_with_warning() -> None:
    assert "reference BLAS" in _blas_in_subprocess("/no/such/libblas.so")


def _timeout_in_subprocess(value: str | None) -> str | None:
    env = {k: v for k, v in os.environ.items() if k not in (backend.BLAS_ENV, backend.OPENBLAS_TIMEOUT_ENV)}
    if value is not None:
        env[backend.OPENBLAS_TIMEOUT_ENV] = value
    code = f"import json, os, mlx_parallm_provider\nprint(json.dumps(os.environ.get({backend.OPENBLAS_TIMEOUT_ENV!r})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or backend.find_openblas() is None, reason="needs the OpenBLAS preload")
def test_openblas_threads_sleep_after_each_call_unless_the_user_says_otherwise() -> None:
    assert _timeout_in_subprocess(None) == backend.OPENBLAS_TIMEOUT  # set before OpenBLAS loads
    assert _timeout_in_subprocess("12") == "12"


def test_should_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend.DEQUANTIZE_ENV, raising=False)
    assert backend.should_dequantize(True) is True
    assert backend.should_dequantize(False) is False
    assert backend.should_dequantize(None) is backend.is_cpu()
    monkeypatch.setenv(backend.DEQUANTIZE_ENV, "0")
    assert backend.should_dequantize(None) is False


def test_prepare_model_dequantizes_to_float32(tiny_model_dir) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    nn.quantize(model, group_size=32, bits=8)
    tokens = mx.array([[5, 6, 7, 8]])
    quantized_logits = model(tokens)
    backend.prepare_model(model, dequantize=True)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert mx.allclose(model(tokens), quantized_logits, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_prepare_model_upcasts_half_precision_weights_on_request(tiny_model_dir, dtype_name: str) -> None:
    """A bf16 / fp16 checkpoint computes in float32 when dequantizing (the CPU default), and
    stays as stored with ``dequantize=False``."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    half = getattr(mx, dtype_name)
    tokens = mx.array([[5, 6, 7, 8]])
    kept, _ = mlx_lm.load(str(tiny_model_dir))
    kept.set_dtype(half)
    backend.prepare_model(kept, dequantize=False)
    assert {p.dtype for _, p in tree_flatten(kept.parameters())} == {half}

    upcast, _ = mlx_lm.load(str(tiny_model_dir))
    upcast.set_dtype(half)
    backend.prepare_model(upcast, dequantize=True)
    assert {p.dtype for _, p in tree_flatten(upcast.parameters())} == {mx.float32}
    # the same weights (rounded to half), now multiplied in float32
    assert mx.allclose(upcast(tokens), kept(tokens).astype(mx.float32), atol=0.5, rtol=0.05)
    assert upcast(tokens).dtype == mx.float32
