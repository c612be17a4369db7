"""16-bit activations on the integer path (``kernels/qmatmul_tiles.h``, ``int8=16``): x quantized
per block of 32 to 15-bit integers, held as two int8 planes that meet the same weight tiles; and
the backend setting that makes it the default where the kernel has the tiles
(``MLX_PARALLM_INT8_MATMUL``)."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_int8_matmul import _reference
from test_small_batch import _build_with_march, _ctypes_kernel, _extension, _quantized, kernel  # noqa: F401

from mlx_parallm_provider.models import qmatmul, small_batch
from mlx_parallm_provider.models.backends import cpu_kernels
from mlx_parallm_provider.models.backends.cpu_kernels import CPUKernels


@pytest.fixture
def tiles(kernel):
    """The kernel (ctypes or extension), where it multiplies over weight tiles (AVX-512 VNNI)."""
    if not cpu_kernels.int8_tiles():
        pytest.skip("no AVX-512 VNNI: the kernel has no weight tiles, so no 16-bit activations")
    return kernel


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 32), (8, 64)])
def test_products_are_the_16_bit_block_quantized_ones_and_near_the_float32_weights(tiles, bits: int, group: int) -> None:
    module = _quantized((97, 384), bits, group)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(tiles)
    x = mx.random.normal((19, 384), key=mx.random.key(3))
    x = x * (1 + 20 * (mx.arange(384) % 97 == 0))  # outlier channels, as real activations have
    got = np.asarray(packed.matmul(tiles, x, int8=16))
    reference = _reference(np.asarray(x), module, levels=32512)
    assert np.abs(got - reference).max() < 1e-6 * np.abs(reference).max()  # float32 sums of the exact block sums
    exact = np.asarray(x @ small_batch._float32_weight(module).T)
    int8 = np.asarray(packed.matmul(tiles, x, int8=8))
    error16, error8 = np.abs(got - exact).max(), np.abs(int8 - exact).max()
    assert error16 < 1e-3 * np.abs(exact).max() and error16 < error8 / 50


def test_a_row_gets_the_same_bits_alone_among_any_rows_and_with_amx_on_or_off(tiles) -> None:
    """Tiles of 8 rows of x (16 plane rows): row counts across their edges, AMX (from 6 rows a
    tile) or ``vpdpbusd``, a weight tile cut short (70 rows), an odd number of blocks."""
    module = _quantized((70, 288), 4, 32)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(tiles)
    x = mx.random.normal((37, 288), key=mx.random.key(4))
    together = np.asarray(packed.matmul(tiles, x, int8=16, threads=2))
    for rows in (1, 5, 6, 7, 8, 9, 15, 16, 17, 30):
        assert np.array_equal(np.asarray(packed.matmul(tiles, x[:rows], int8=16)), together[:rows])
    alone = np.stack([np.asarray(packed.matmul(tiles, x[m:m + 1], int8=16))[0] for m in (0, 7, 8, 15, 36)])
    assert np.array_equal(alone, together[[0, 7, 8, 15, 36]])
    lib = _ctypes_kernel()
    if qmatmul.amx(lib):
        qmatmul.amx(lib, False)
        try:
            assert np.array_equal(np.asarray(packed.matmul(tiles, x, int8=16, threads=2)), together)
        finally:
            qmatmul.amx(lib, True)


def test_the_extension_and_the_ctypes_kernel_agree_exactly() -> None:
    ext, lib = _extension(), _ctypes_kernel()
    if not cpu_kernels.int8_tiles():
        pytest.skip("no AVX-512 VNNI")
    module = _quantized((40, 192), 8, 64)
    packed = small_batch.PackedWeight.from_module(module)
    x = mx.random.normal((23, 192), key=mx.random.key(5))
    assert np.array_equal(np.asarray(packed.matmul(lib, x, int8=16)), np.asarray(packed.for_kernel(ext).matmul(ext, x, int8=16)))


def test_a_build_without_tiles_refuses_16_bit_activations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 build (``x86-64-v3``; lanes, no tiles) returns -1: the caller gets an error, never
    int8 products in their place."""
    if not {"avx2", "fma"} <= qmatmul.cpu_flags():
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    lib = _build_with_march("x86-64-v3", tmp_path, monkeypatch)
    assert lib is not None and not lib.qm_int8_tiles()
    packed = small_batch.PackedWeight.from_module(_quantized((32, 64), 4, 32))
    with pytest.raises(ValueError, match="unsupported"):
        packed.matmul(lib, mx.ones((2, 64)), int8=16)


@pytest.mark.parametrize("value,tiles,expected", [
    (None, True, 16), (None, False, 0), ("0", True, 0), ("off", True, 0), ("1", True, 8), ("true", False, 8),
    ("8", True, 8), ("16", True, 16), ("16", False, 8), ("sixteen", True, 16), ("sixteen", False, 0),
])
def test_the_setting_defaults_to_16_bit_activations_where_the_kernel_has_tiles(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value, tiles: bool, expected: int) -> None:
    monkeypatch.setattr(cpu_kernels, "int8_tiles", lambda: tiles)
    if value is None:
        monkeypatch.delenv(cpu_kernels.INT8_MATMUL_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_kernels.INT8_MATMUL_ENV, value)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.int8_setting() == expected
    warned = value in ("sixteen",) or (value == "16" and not tiles)
    assert bool(caplog.records) == warned
    backend = CPUKernels()
    assert (backend.int8_matmul, backend.activation_bits) == (expected > 0, expected or 8)
    assert CPUKernels(int8_matmul=False).int8_matmul is False  # an explicit choice is kept


def test_by_default_every_row_count_takes_16_bit_activations_and_batched_equals_alone(
        tiny_model_dir: Path, make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default on a CPU with the tiles: the engine's every matmul call (prefill, 12-row and
    1-row steps) asks for 16-bit activations, and greedy rows get the same tokens together or
    alone."""
    from test_small_batch import _quantized_tiny

    from mlx_parallm_provider.engine import SamplingParams
    from mlx_parallm_provider.models import backend, backends

    ext = _extension()
    if not cpu_kernels.int8_tiles():
        pytest.skip("no AVX-512 VNNI: the float32 kernels are the default here")
    calls: list[tuple[int, int]] = []

    def counting(x, *a):
        calls.append((x.size // x.shape[-1], int(a[7]) if len(a) > 7 else 0))
        return ext.qmatmul(x, *a)

    monkeypatch.setattr(small_batch, "load_kernel", lambda: type("K", (), {"qmatmul": staticmethod(counting)})())
    monkeypatch.delenv(cpu_kernels.INT8_MATMUL_ENV, raising=False)
    model = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(model, dequantize=True)
    assert (backends.of(model).int8_matmul, backends.of(model).activation_bits) == (True, 16)
    prompts = [[1, 5 + i, 9, 30 + 3 * i] for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = make_engine(model)
    together = engine.generate_many_sync(prompts, params)
    alone = [engine.generate_many_sync([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert calls and {bits for _, bits in calls} == {16} and max(rows for rows, _ in calls) >= 12 and 1 in {rows for rows, _ in calls}
