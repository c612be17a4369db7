"""CPU backend choices: BLAS preload before mlx, dequantize-at-load on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mlx_parallm_provider.models import backend

PROBE = (
    "import json, mlx_parallm_provider.models, mlx.core as mx\n"
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
    code = f"import json, os, mlx_parallm_provider.models\nprint(json.dumps(os.environ.get({backend.OPENBLAS_TIMEOUT_ENV!r})))"
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
    q_proj = model.model.layers[0].self_attn.q_proj
    assert "weight" not in q_proj or q_proj.weight.dtype == mx.float32  # packed weights alone, or a float32 copy
    assert model(tokens).dtype == mx.float32
    assert mx.allclose(model(tokens), quantized_logits, atol=1e-2, rtol=1e-2)


def test_on_a_gpu_dequantized_weights_keep_the_checkpoints_precision(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dequantize-once on a GPU: dense weights in the scales' bfloat16 (not the CPU's float32),
    each exactly what its quantized layer multiplies by."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_flatten

    model, _ = mlx_lm.load(str(tiny_model_dir))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=8)
    q = model.model.layers[0].self_attn.q_proj
    expected = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits)
    tokens = mx.array([[5, 6, 7, 8]])
    quantized_logits = model(tokens).astype(mx.float32)
    monkeypatch.setattr(backend, "is_cpu", lambda: False)
    backend.prepare_model(model, dequantize=True, engine=False)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert mx.array_equal(model.model.layers[0].self_attn.q_proj.weight, expected)
    logits = model(tokens)
    assert logits.dtype == mx.bfloat16
    # The same products, rounded to bfloat16 elsewhere than in the quantized kernels (6% here,
    # where MLX's CPU bfloat16 matmuls round more than a GPU's; wrong weights give ~100%).
    error = mx.linalg.norm(logits.astype(mx.float32) - quantized_logits) / mx.linalg.norm(quantized_logits)
    assert error.item() < 0.15


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


ORDER_PROBE = (
    "import json, sys\n"
    "if sys.argv[1] == 'mlx-first':\n"
    "    import mlx.core as mx, mlx_parallm_provider\n"
    "else:\n"
    "    import mlx_parallm_provider.models, mlx.core as mx\n"
    "from mlx_parallm_provider.models import backend, private_blas, registry\n"
    "model = registry.load(sys.argv[2]).model\n"
    "logits = model(mx.array([[5, 6, 7, 8], [9, 10, 11, 12]]))\n"
    "print(json.dumps({'blas': backend.blas_in_use(), 'layer': type(model.model.layers[0].self_attn.q_proj).__name__,\n"
    "                  'head': type(model.model.embed_tokens).__name__, 'logits': logits[:, :, :64].tolist()}))\n"
)


def _order_in_subprocess(order: str, model_dir) -> dict:
    env = {k: v for k, v in os.environ.items() if k != backend.BLAS_ENV}
    out = subprocess.run([sys.executable, "-c", ORDER_PROBE, order, str(model_dir)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or backend.find_openblas() is None, reason="needs a system OpenBLAS")
def test_importing_mlx_first_still_multiplies_through_openblas(tiny_model_dir) -> None:
    """Issue 22 item 5: mlx imported first binds MLX to its reference BLAS; the model's dense
    layers and tied head then go through OpenBLAS bound privately, with the same logits."""
    import numpy as np

    from mlx_parallm_provider.models import qmatmul_ext

    if qmatmul_ext.load() is None:
        pytest.skip("the MLX extension does not build here (the BackendError case is tested below)")
    first, usual = _order_in_subprocess("mlx-first", tiny_model_dir), _order_in_subprocess("package-first", tiny_model_dir)
    assert first["blas"].startswith("reference") and usual["blas"].startswith("OpenBLAS")
    assert (first["layer"], first["head"]) == ("PrivateBlasLinear", "PrivateBlasEmbedding")
    assert (usual["layer"], usual["head"]) == ("Linear", "Embedding")
    np.testing.assert_allclose(np.array(first["logits"]), np.array(usual["logits"]), rtol=1e-4, atol=1e-4)


def test_mlx_first_without_the_extension_is_a_backend_error_saying_how_to_fix_it(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm

    from mlx_parallm_provider import BackendError
    from mlx_parallm_provider.models import private_blas, qmatmul_ext

    monkeypatch.setattr(private_blas, "needed", lambda blas=None: True)
    monkeypatch.setattr(private_blas, "_bound", None)
    monkeypatch.setattr(qmatmul_ext, "load", lambda: None)
    model, _ = mlx_lm.load(str(tiny_model_dir))
    with pytest.raises(BackendError) as info:
        backend.prepare_model(model, dequantize=True)
    assert "Import mlx_parallm_provider.engine (or call get_engine) before mlx" in str(info.value) and backend.BLAS_ENV in str(info.value)


def test_dense_computes_what_nn_linear_does() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_parallm_provider.models import private_blas

    layer = nn.Linear(24, 40)
    x = mx.random.normal((3, 5, 24))
    assert mx.allclose(private_blas.dense(x, layer.weight, layer.bias), layer(x), atol=1e-5)
    assert mx.allclose(private_blas.PrivateBlasLinear(layer)(x), layer(x), atol=1e-5)


def test_doctor_prints_the_backend_blas_features_kernels_cache_and_versions(capsys: pytest.CaptureFixture[str]) -> None:
    from mlx_parallm_provider import cli
    from mlx_parallm_provider.cpu_info import cpu_model_name

    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines())  # "key   value"
    for key in ("device", "blas", "dense layers", "cpu vector features", "kernel cache", "model cache", "version mlx", "version mlx-lm"):
        assert key in lines, (key, out)
    assert lines["blas"] == backend.blas_in_use()
    assert lines["cpu"] == cpu_model_name(with_machine=True)
    assert lines["version mlx"] == __import__("mlx.core").core.__version__
    assert lines["version mlx-parallm-provider"] == __import__("mlx_parallm_provider").__version__  # the code running
    if backend.is_cpu():
        from mlx_parallm_provider.models import qmatmul

        expected = "lanes" if "avx512_vnni" not in qmatmul.cpu_flags() else ("tiles, AMX" if "amx_int8" in qmatmul.cpu_flags() else "tiles, vpdpbusd")
        assert lines["int8 matmul"].startswith(expected + "; "), out
        # the default: 16-bit activations where the kernel has the tiles, else the float kernels
        if os.environ.get("MLX_PARALLM_INT8_MATMUL") is None:
            assert lines["int8 matmul"].endswith("; on, 16-bit activations (MLX_PARALLM_INT8_MATMUL)" if expected != "lanes"
                                                 else "; off (MLX_PARALLM_INT8_MATMUL)"), out


def test_the_cuda_headers_are_found_where_mlx_looks_for_them_in_its_order(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVIDIA's runtime package beside MLX first, then $CUDA_HOME / $CUDA_PATH, then the
    system toolkit; a folder without cuda_runtime.h does not count."""
    from pathlib import Path

    from mlx_parallm_provider import doctor
    from mlx_parallm_provider.models import device

    def toolkit(path: Path, headers: bool = True) -> Path:
        (path / "include").mkdir(parents=True)
        if headers:
            (path / "include" / "cuda_runtime.h").write_text("// headers")
        return path

    site = tmp_path / "site-packages"
    monkeypatch.setattr(device, "SYSTEM_CUDA", tmp_path / "no-system-cuda")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert device.cuda_headers(site) is None
    monkeypatch.setattr(device, "SYSTEM_CUDA", toolkit(tmp_path / "usr-local-cuda"))
    assert device.cuda_headers(site) == tmp_path / "usr-local-cuda" / "include"
    monkeypatch.setenv("CUDA_PATH", str(toolkit(tmp_path / "path-toolkit")))
    assert device.cuda_headers(site) == tmp_path / "path-toolkit" / "include"
    monkeypatch.setenv("CUDA_HOME", str(toolkit(tmp_path / "home-toolkit")))
    assert device.cuda_headers(site) == tmp_path / "home-toolkit" / "include"
    toolkit(site / "nvidia" / "cu13", headers=False)  # an empty include/ is passed over
    assert device.cuda_headers(site) == tmp_path / "home-toolkit" / "include"
    toolkit(site / "nvidia" / "cuda_runtime")  # nvidia-cuda-runtime-cu12
    assert device.cuda_headers(site) == site / "nvidia" / "cuda_runtime" / "include"

    # doctor says so on a CUDA GPU only
    assert doctor._cuda_headers() == {}
    monkeypatch.setattr(device, "gpu_platform", lambda: "cuda")
    monkeypatch.setattr(device, "cuda_headers", lambda: None)
    assert doctor._cuda_headers()["CUDA headers"].startswith("none found: MLX cannot compile kernels")


def test_describe_names_a_models_backend_and_how_its_attention_reads_the_paged_kv(tiny_model_dir) -> None:
    """What ``Engine.stats()`` reports: the CPU kernels' path (what doctor prints for them),
    MLX's ops gathering, and a model no backend was installed on (its own attention code)."""
    import mlx_lm

    from mlx_parallm_provider.models import attention, backends

    model, _ = mlx_lm.load(str(tiny_model_dir))
    assert backends.describe(model) == {"backend": None, "attention": "gather (the model's own attention code)"}
    with backends.using(model, "cpu"):
        cpu_path = "CPU kernel through the block tables" if attention.has_attention_step() else "gather (the CPU kernels' extension is not built)"
        assert backends.describe(model) == {"backend": "cpu", "attention": cpu_path}
    with backends.using(model, "mlx"):
        assert backends.describe(model) == {"backend": "mlx", "attention": "gather (MLX's ops)"}
    assert backends.describe(model)["backend"] is None  # given back as it was
