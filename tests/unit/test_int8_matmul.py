"""The int8 path of the packed-weight kernel (``kernels/qmatmul_int8.h``, issue 23): activations
quantized per row in blocks of 32, integer dot products with the packed weights, at any number
of rows; and the backend setting that sends every quantized layer there
(``MLX_PARALLM_INT8_MATMUL``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_small_batch import _build_with_march, _ctypes_kernel, _extension, _quantized, _quantized_tiny, kernel  # noqa: F401

from mlx_parallm_provider.models import backend, backends, qmatmul, small_batch


def _reference(x: np.ndarray, module: nn.QuantizedLinear, levels: int = 127) -> np.ndarray:
    """What the int8 path computes, in numpy: x's blocks of 32 rounded to int8 (half to even;
    ``levels`` 32512 for 16-bit activations) times the weights' integers, scaled per block and
    group, plus bias x group sums."""
    group = module.group_size
    scales = np.asarray(module.scales.astype(mx.float32))
    biases = np.asarray(module.biases.astype(mx.float32))
    w = np.asarray(small_batch._float32_weight(module))
    q = np.rint((w - np.repeat(biases, group, axis=1)) / np.repeat(scales, group, axis=1))  # the stored integers
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(levels) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(blocks * inv)
    d = (amax / np.float32(levels)).astype(np.float64)
    per_block = np.einsum("mbi,nbi->mnb", xq, q.reshape(q.shape[0], -1, 32)) * d[:, None, :, 0]
    block_scale = np.repeat(scales, group // 32, axis=1)  # (N, blocks)
    sums = x.reshape(x.shape[0], -1, group).sum(axis=2)  # (M, groups)
    return (per_block * block_scale[None]).sum(axis=2) + sums @ biases.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int8_products_are_the_block_quantized_ones_and_near_the_float32_weights(kernel, bits: int, group: int) -> None:
    module = _quantized((97, 384), bits, group)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(kernel)
    x = mx.random.normal((19, 384), key=mx.random.key(3))
    x = x * (1 + 20 * (mx.arange(384) % 97 == 0))  # outlier channels, as real activations have
    got = np.asarray(packed.matmul(kernel, x, int8=True))
    assert got.shape == (19, 97)
    assert np.allclose(got, _reference(np.asarray(x), module), rtol=1e-4, atol=1e-3)
    exact = np.asarray(x @ small_batch._float32_weight(module).T)
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()  # int8 activations: ~1% here
    assert not np.array_equal(got, exact)


def test_a_row_gets_the_same_bits_alone_and_among_any_number_of_rows(kernel) -> None:
    """Batched == alone exactly: every row count (register tiles of 4, 8 or 16 rows, more than
    the float kernel's 64) computes a row by the same operations."""
    module = _quantized((70, 256), 4, 32)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(kernel)
    x = mx.random.normal((130, 256), key=mx.random.key(4))
    together = np.asarray(packed.matmul(kernel, x, int8=True, threads=2))
    for rows in (1, 3, 16, 17, 65):
        part = np.asarray(packed.matmul(kernel, x[:rows], int8=True))
        assert np.array_equal(part, together[:rows])
    alone = np.stack([np.asarray(packed.matmul(kernel, x[m:m + 1], int8=True))[0] for m in (0, 15, 16, 129)])
    assert np.array_equal(alone, together[[0, 15, 16, 129]])


def test_the_extension_and_the_ctypes_kernel_agree_exactly() -> None:
    ext, lib = _extension(), _ctypes_kernel()
    module = _quantized((40, 192), 8, 64)
    packed = small_batch.PackedWeight.from_module(module)
    x = mx.random.normal((9, 192), key=mx.random.key(5))
    assert np.array_equal(np.asarray(packed.matmul(lib, x, int8=True)), np.asarray(packed.for_kernel(ext).matmul(ext, x, int8=True)))


def test_forced_avx2_and_portable_builds_compute_the_block_quantized_products(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 (``vpmaddubsw``; ``x86-64-v3`` on an AVX-512 machine) and portable (no
    ``-march``) paths, which a VNNI machine's native build never runs."""
    builds = []
    if {"avx2", "fma"} <= qmatmul.cpu_flags():
        builds.append(_build_with_march("x86-64-v3", tmp_path / "avx2", monkeypatch))
    monkeypatch.delenv(qmatmul.MARCH_ENV, raising=False)
    monkeypatch.setattr(qmatmul, "native_flags", lambda compiler: [])
    builds.append(_build_with_march("native", tmp_path / "portable", monkeypatch))
    for lib in builds:
        assert lib is not None and qmatmul.int8_path(lib) == "lanes"
        for bits, group in [(4, 32), (8, 64)]:
            module = _quantized((50, 256), bits, group)
            x = mx.random.normal((11, 256), key=mx.random.key(bits))
            got = np.asarray(small_batch.PackedWeight.from_module(module).matmul(lib, x, int8=True))
            assert np.allclose(got, _reference(np.asarray(x), module), rtol=1e-4, atol=1e-3)


def test_with_int8_matmul_every_row_count_takes_the_int8_kernel_and_no_float32_copy_is_kept(
        tiny_model_dir: Path, make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_parallm_provider.engine import SamplingParams

    ext = _extension()
    calls: list[tuple[int, bool]] = []

    def counting(x, *a):
        calls.append((x.size // x.shape[-1], bool(a[7]) if len(a) > 7 else False))
        return ext.qmatmul(x, *a)

    monkeypatch.setattr(small_batch, "load_kernel", lambda: type("K", (), {"qmatmul": staticmethod(counting)})())
    monkeypatch.setenv(small_batch.FLOAT32_ENV, "1")  # int8 keeps no copy even where copies are asked for
    monkeypatch.setenv("MLX_PARALLM_INT8_MATMUL", "1")
    model = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(model, dequantize=True)
    assert backends.of(model).int8_matmul is True
    assert not [n for n, m in model.named_modules() if isinstance(m, (small_batch.SmallBatchLinear, small_batch.SmallBatchEmbedding)) and "weight" in m]

    prompts = [[1, 5 + i, 9, 30 + 3 * i] for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = make_engine(model)
    together = engine.generate_many_sync(prompts, params)  # prefill and 12-row steps
    alone = [engine.generate_many_sync([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert calls and all(int8 for _, int8 in calls) and max(rows for rows, _ in calls) >= 12 and 1 in {rows for rows, _ in calls}


@pytest.fixture
def amx_kernel(kernel):
    """The ctypes kernel with AMX on (skipped where this CPU has none: issue 23's CI machine, an
    Intel Xeon with AMX, runs these), turned back on after the test."""
    lib = _ctypes_kernel()
    if not qmatmul.amx(lib, True):
        pytest.skip("no AMX on this CPU (or Linux refused it)")
    yield lib
    qmatmul.amx(lib, True)


@pytest.mark.parametrize("bits,group,shape", [(4, 32, (70, 96)), (4, 64, (33, 384)), (8, 32, (40, 160)), (4, 128, (64, 256))])
def test_amx_tiles_compute_the_block_quantized_products_the_same_for_a_row_alone_or_in_company(
        amx_kernel, bits: int, group: int, shape: tuple[int, int]) -> None:
    """``qmatmul_tiles.h``: 16-row AMX tiles (``tdpbsud``) from 12 rows of x, ``vpdpbusd`` over the
    same transposed weights below; weight-row tiles cut short (70, 33 rows), an odd number of
    blocks (96: 3), 8-bit weights. Both give exact block sums and each row's float sums run in
    one order whatever its company, so every row count gives a row the same bits, and so does
    the kernel with AMX off."""
    module = _quantized(shape, bits, group)
    packed = small_batch.PackedWeight.from_module(module)
    x = mx.random.normal((37, shape[1]), key=mx.random.key(6))
    together = np.asarray(packed.matmul(amx_kernel, x, int8=True, threads=2))
    assert np.allclose(together, _reference(np.asarray(x), module), rtol=1e-4, atol=1e-3)
    for rows in (1, 3, 4, 11, 12, 16, 17, 20, 28):
        assert np.array_equal(np.asarray(packed.matmul(amx_kernel, x[:rows], int8=True)), together[:rows])
    alone = np.stack([np.asarray(packed.matmul(amx_kernel, x[m:m + 1], int8=True))[0] for m in (0, 3, 15, 16, 36)])
    assert np.array_equal(alone, together[[0, 3, 15, 16, 36]])
    assert qmatmul.int8_path(amx_kernel) == "tiles, AMX"
    assert qmatmul.amx(amx_kernel, False) is False
    assert qmatmul.int8_path(amx_kernel) == "tiles, vpdpbusd"
    assert np.array_equal(np.asarray(packed.matmul(amx_kernel, x, int8=True, threads=2)), together)


def test_amx_off_by_environment(amx_kernel) -> None:
    """``MLX_PARALLM_AMX=0`` keeps AMX off (read at the first int8 call, in a child)."""
    import os
    import subprocess
    import sys

    code = ("import mlx_parallm_provider\nfrom mlx_parallm_provider.models import qmatmul\n"
            "print(qmatmul.amx(qmatmul.load()))")
    got = {}
    for value in ("0", "1"):
        env = {**os.environ, qmatmul.AMX_ENV: value}
        got[value] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
    assert got == {"0": "False", "1": "True"}


def test_a_vnni_build_without_amx_computes_what_the_native_build_does(kernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX-512 VNNI CPU without AMX (Ice Lake, Zen 4; ``icelake-server`` forced on a CPU
    that runs it) takes the same tiles through ``vpdpbusd`` alone: the same bits as the native
    build, at every row count."""
    if "amx_int8" not in qmatmul.cpu_flags() or qmatmul.march_problem("cc", "icelake-server") is not None:
        pytest.skip("not a CPU with AMX that runs an icelake-server build")
    native = _ctypes_kernel()
    vnni = _build_with_march("icelake-server", tmp_path / "vnni", monkeypatch)
    assert vnni is not None and qmatmul.int8_path(vnni) == "tiles, vpdpbusd"
    for bits, group in [(4, 32), (8, 64)]:
        module = _quantized((50, 256), bits, group)
        packed = small_batch.PackedWeight.from_module(module)
        x = mx.random.normal((21, 256), key=mx.random.key(bits + 1))
        for rows, activation_bits in itertools.product((1, 5, 21), (8, 16)):  # 16: two planes
            assert np.array_equal(np.asarray(packed.matmul(vnni, x[:rows], int8=activation_bits)),
                                  np.asarray(packed.matmul(native, x[:rows], int8=activation_bits)))


def test_device_config_amx_reaches_every_loaded_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DeviceConfig.amx`` is set on each loaded kernel from Python (the C reads no environment):
    at load where it is off, and on those already loaded when an engine's model is prepared."""
    from mlx_parallm_provider import DeviceConfig

    monkeypatch.setattr(qmatmul, "_amx_switches", [])
    monkeypatch.setattr(qmatmul, "_amx", None)
    monkeypatch.setattr(qmatmul, "_march", None)
    calls: list[tuple[str, int]] = []
    qmatmul.add_amx_switch(lambda request: calls.append(("first", request)))
    assert calls == ([] if DeviceConfig().amx else [("first", 0)])
    calls.clear()
    qmatmul.configure(DeviceConfig(amx=False))
    qmatmul.add_amx_switch(lambda request: calls.append(("second", request)))  # loaded after: off at once
    assert calls == [("first", 0), ("second", 0)]
    qmatmul.configure(DeviceConfig(amx=True))
    assert calls[-2:] == [("first", 1), ("second", 1)] and qmatmul.amx_setting() is True


def test_device_config_amx_off_turns_the_tiles_off(amx_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_parallm_provider import DeviceConfig

    monkeypatch.setattr(qmatmul, "_amx_switches", [amx_kernel.qm_amx])
    monkeypatch.setattr(qmatmul, "_amx", None)
    qmatmul.configure(DeviceConfig(amx=False))
    assert qmatmul.int8_path(amx_kernel) == "tiles, vpdpbusd"
    qmatmul.configure(DeviceConfig(amx=True))
    assert qmatmul.int8_path(amx_kernel) == "tiles, AMX"
