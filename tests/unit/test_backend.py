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
