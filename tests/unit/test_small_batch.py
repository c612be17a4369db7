"""The packed-weight kernel for steps of a few rows (models/qmatmul.py, models/qmatmul_ext.py,
models/small_batch.py): through ctypes and as an MLX primitive."""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_parallm_provider.models import backend, backends, qmatmul, qmatmul_ext, small_batch


@pytest.fixture(autouse=True)
def float_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of the float kernels (the integer path, the default on CPUs with AVX-512
    VNNI, has test_int8_matmul.py)."""
    monkeypatch.setenv("MLX_PARALLM_INT8_MATMUL", "0")


def _ctypes_kernel():
    lib = qmatmul.load()
    if lib is None:  # the fallback has its own test below
        pytest.skip("no C compiler on this machine")
    return lib


def _extension():
    ext = qmatmul_ext.load()
    if ext is None:
        pytest.skip("the MLX extension does not build here (no C++ compiler or nanobind)")
    return ext


@pytest.fixture(params=["ctypes", "extension"])
def kernel(request):
    return _ctypes_kernel() if request.param == "ctypes" else _extension()


def _counting(kernel, calls: list[int], monkeypatch: pytest.MonkeyPatch):
    """``kernel`` as the model's layers will get it, recording the rows of each call."""
    if isinstance(kernel, ctypes.CDLL):
        real = qmatmul.qmatmul
        monkeypatch.setattr(qmatmul, "qmatmul", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
        counted = kernel
    else:
        def counting(x, *a):  # the tiled GEMM's calls (gemm=True, a[6]) are not the packed kernel's
            if not (len(a) > 6 and a[6]):
                calls.append(x.size // x.shape[-1])
            return kernel.qmatmul(x, *a)

        counted = SimpleNamespace(qmatmul=counting)
    monkeypatch.setattr(small_batch, "load_kernel", lambda: counted)
    return counted


def _quantized(shape: tuple[int, int], bits: int, group: int, seed: int = 0):
    w = mx.random.normal(shape, key=mx.random.key(seed))
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    module = nn.QuantizedLinear(shape[1], shape[0], bias=False, group_size=group, bits=bits)
    module.weight, module.scales, module.biases = wq, scales.astype(mx.float16), biases.astype(mx.float16)
    return module


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, qmatmul.MAX_ROWS])  # 9+: several register tiles
def test_kernel_equals_mlx_on_the_float32_dequantized_weight(kernel, bits: int, group: int, rows: int) -> None:
    module = _quantized((97, 384), bits, group)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(kernel)
    x = mx.random.normal((rows, 384), key=mx.random.key(1))
    expected = x @ small_batch._float32_weight(module).T
    got = packed.matmul(kernel, x)
    assert got.shape == (rows, 97)
    assert np.allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_extension_equals_the_ctypes_kernel(bits: int, group: int) -> None:
    lib, ext = _ctypes_kernel(), _extension()
    packed = small_batch.PackedWeight.from_module(_quantized((130, 256), bits, group))
    on_mlx = packed.for_kernel(ext)
    assert isinstance(on_mlx.packed, mx.array) and on_mlx.packed.dtype == mx.uint8
    for rows in range(1, 9):
        x = mx.random.normal((rows, 256), key=mx.random.key(rows))
        assert np.array_equal(np.asarray(on_mlx.matmul(ext, x)), np.asarray(packed.matmul(lib, x)))


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_threads_compute_exactly_what_one_thread_does_even_with_concurrent_callers(kernel, threads: int) -> None:
    """The kernel's helper threads claim chunks of weight rows: every row of every call is
    computed once, the same way, whichever thread takes it, also while another thread calls
    (it then computes alone)."""
    import concurrent.futures

    cases = [(small_batch.PackedWeight.from_module(_quantized(shape, bits, 32, seed)).for_kernel(kernel), rows, shape[1])
             for seed, (shape, bits, rows) in enumerate([((4099, 256), 4, 1), ((2048, 512), 8, 3), ((9000, 128), 4, 8), ((77, 256), 4, 64)])]
    inputs = [mx.random.normal((rows, k), key=mx.random.key(i)) for i, (_, rows, k) in enumerate(cases)]
    alone = [np.asarray(p.matmul(kernel, x)) for (p, _, _), x in zip(cases, inputs)]

    def run(_: int) -> bool:
        return all(np.array_equal(np.asarray(p.matmul(kernel, x, threads)), a) for (p, _, _), x, a in zip(cases, inputs, alone) for _ in range(5))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(pool.map(run, range(6)))
    from mlx_parallm_provider.models import private_blas

    if not isinstance(kernel, ctypes.CDLL) and private_blas.bind_for_gemm():  # the tiled GEMM dequantizes on the threads too
        tiled = small_batch.PackedWeight.from_module(_quantized((40000, 128), 4, 32, 7)).for_kernel(kernel)  # 3 tiles
        x = mx.random.normal((100, 128), key=mx.random.key(9))
        one = np.asarray(tiled.matmul(kernel, x, 1, gemm=True))
        assert np.array_equal(np.asarray(tiled.matmul(kernel, x, threads, gemm=True)), one)
        assert np.allclose(one, np.asarray(x @ small_batch._float32_weight(_quantized((40000, 128), 4, 32, 7)).T), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 128, 129, 300])  # panels up to 128 rows, BLAS tiles above
@pytest.mark.parametrize("threads", [1, 2])
def test_the_gemm_path_equals_mlx_on_the_float32_dequantized_weight(bits: int, group: int, rows: int, threads: int) -> None:
    from mlx_parallm_provider.models import private_blas

    ext = _extension()
    if rows > 128 and not private_blas.bind_for_gemm():
        pytest.skip("no BLAS bound for the tiles of more than 128 rows")
    module = _quantized((53, 256), bits, group, seed=rows)  # 53: panels of 16 and tiles of 4 weight rows, with remainders
    packed = small_batch.PackedWeight.from_module(module).for_kernel(ext)
    x = mx.random.normal((rows, 256), key=mx.random.key(rows))
    expected = np.asarray(x @ small_batch._float32_weight(module).T)
    got = np.asarray(packed.matmul(ext, x, threads, gemm=True))
    assert got.shape == expected.shape and np.allclose(got, expected, rtol=1e-4, atol=1e-4)
    if rows <= 128:  # a row's outputs do not depend on the rows beside it in the panels
        alone = np.asarray(packed.matmul(ext, x[:1], threads, gemm=True))
        assert np.array_equal(got[:1], alone)


def test_the_ctypes_library_exports_the_panel_gemm() -> None:
    lib = _ctypes_kernel()
    module = _quantized((37, 128), 4, 32)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(lib)  # numpy arrays
    x = np.asarray(mx.random.normal((11, 128), key=mx.random.key(3)))
    out = np.empty((11, 37), dtype=np.float32)
    status = lib.qgemm_panels(x.ctypes.data, 11, 128, packed.packed.ctypes.data, packed.scales.ctypes.data, packed.biases.ctypes.data,
                              37, 4, 32, out.ctypes.data, 2)
    assert status == 0
    assert np.allclose(out, np.asarray(mx.array(x) @ small_batch._float32_weight(module).T), rtol=1e-4, atol=1e-4)


def test_extension_reads_strided_lazy_inputs() -> None:
    ext = _extension()
    module = _quantized((40, 128), 4, 32)
    packed = small_batch.PackedWeight.from_module(module).for_kernel(ext)
    x = mx.random.normal((128, 3), key=mx.random.key(2)).T  # column-major rows
    y = packed.matmul(ext, x[None] * 2.0)  # lazy input, batch axis kept
    assert y.shape == (1, 3, 40) and y.dtype == mx.float32
    expected = (x * 2.0) @ small_batch._float32_weight(module).T
    assert np.allclose(np.asarray(y[0]), np.asarray(expected), rtol=1e-5, atol=1e-4)

def test_the_portable_path_computes_what_the_native_one_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built without ``-march=native`` the kernel takes its portable path (GCC vector
    extensions; the AVX2 path needs AVX2, forced below), which must give the same products."""
    native = _ctypes_kernel()
    monkeypatch.setenv("MLX_PARALLM_HOME", str(tmp_path))
    monkeypatch.setattr(qmatmul, "native_flags", lambda compiler: [])
    qmatmul.reset()
    try:
        portable = qmatmul.load()
    finally:
        qmatmul.reset()
    assert portable is not None and portable is not native
    _assert_float32_products(native, portable)


def _assert_float32_products(*libs) -> None:
    """Each kernel library's products == the float32 weights' (4- and 8-bit, groups 32-128),
    through the few-row kernel and the panels (50 weight rows: 3 full panels and a partial one;
    11 rows of x), where a row's outputs do not depend on the rows beside it."""
    for bits, group in [(4, 32), (4, 128), (8, 64)]:
        module = _quantized((50, 256), bits, group)
        packed = small_batch.PackedWeight.from_module(module).for_kernel(libs[0])  # numpy arrays
        x = mx.random.normal((11, 256), key=mx.random.key(bits + group))
        expected = np.asarray(x @ small_batch._float32_weight(module).T)
        for lib in libs:
            assert np.allclose(np.asarray(packed.matmul(lib, x)), expected, rtol=1e-5, atol=1e-4)
            panels = np.empty(expected.shape, dtype=np.float32)  # the many-row path (qmatmul_gemm.h) too
            rows = np.asarray(x)
            assert lib.qgemm_panels(rows.ctypes.data, 11, 256, packed.packed.ctypes.data, packed.scales.ctypes.data,
                                    packed.biases.ctypes.data, 50, bits, group, panels.ctypes.data, 2) == 0
            assert np.allclose(panels, expected, rtol=1e-5, atol=1e-4)
            for r in (0, 6, 10):  # a row alone (and each tile of x's rows) gives what it gave among 11
                alone = np.empty((1, 50), dtype=np.float32)
                assert lib.qgemm_panels(rows[r:].ctypes.data, 1, 256, packed.packed.ctypes.data, packed.scales.ctypes.data,
                                        packed.biases.ctypes.data, 50, bits, group, alone.ctypes.data, 2) == 0
                assert np.array_equal(alone[0], panels[r])


def _build_with_march(march: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLX_PARALLM_HOME", str(tmp_path))
    monkeypatch.setenv(qmatmul.MARCH_ENV, march)
    qmatmul.reset()
    try:
        return qmatmul.load()
    finally:
        qmatmul.reset()


def test_a_forced_avx2_build_computes_what_the_native_one_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MLX_PARALLM_KERNEL_MARCH=x86-64-v3`` builds the AVX2 + FMA intrinsics path, which an
    AVX-512 machine's native build never runs; it must give the same products."""
    native = _ctypes_kernel()
    if not {"avx2", "fma"} <= qmatmul.cpu_flags():
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    assert qmatmul.march_problem("cc", "x86-64-v3") is None
    avx2 = _build_with_march("x86-64-v3", tmp_path, monkeypatch)
    assert avx2 is not None and avx2 is not native
    _assert_float32_products(avx2)


@pytest.mark.parametrize("march", ["x86-64-v3; rm -rf /", "no-such-isa-anywhere"])
def test_a_kernel_march_that_cannot_run_here_is_warned_about_and_ignored(march: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    _ctypes_kernel()
    assert qmatmul.march_problem("cc", march) is not None
    monkeypatch.setenv(qmatmul.MARCH_ENV, march)
    monkeypatch.setattr(qmatmul, "_warned", set())  # (warned once a process)
    with caplog.at_level("WARNING", logger=qmatmul.__name__):
        flags = qmatmul.native_flags("cc")
    assert flags in (["-march=native"], []) and qmatmul.MARCH_ENV in caplog.text


def test_a_kernel_march_with_features_the_cpu_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _ctypes_kernel()
    probe = "x86-64-v3" if qmatmul.march_problem("cc", "x86-64-v3") is None else "armv8.2-a+dotprod"
    if qmatmul.march_problem("cc", probe) is not None:
        pytest.skip("the compiler targets neither x86-64-v3 nor armv8.2-a+dotprod here")
    monkeypatch.setattr(qmatmul, "cpu_flags", lambda: set())  # a CPU with no vector features
    assert "this CPU lacks" in qmatmul.march_problem("cc", probe)


def test_march_problem_reads_the_cpus_flags_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    if qmatmul.march_problem("cc", "x86-64-v3") is not None:
        pytest.skip("not an x86 CPU that runs x86-64-v3 with a compiler that targets it")
    reads: list[int] = []
    monkeypatch.setattr(qmatmul, "cpu_flags", lambda: reads.append(1) or {"avx", "avx2"})  # no fma, f16c, bmi2
    assert qmatmul.march_problem("cc", "x86-64-v3") == "this CPU lacks bmi2, f16c, fma"
    assert len(reads) == 1  # not once per feature macro x86-64-v3 defines


def test_isa_macros_name_the_vector_features_a_march_turns_on() -> None:
    """What the forced x86-64-v3 build's test compares with this CPU's own build to skip it."""
    if qmatmul.isa_macros("cc", ["-march=x86-64-v3"]) is None:
        pytest.skip("the compiler does not target x86-64-v3")
    assert qmatmul.isa_macros("cc", ["-march=x86-64-v3"]) == {"__AVX__", "__AVX2__", "__FMA__", "__F16C__", "__BMI2__"}
    assert qmatmul.isa_macros("cc", ["-march=x86-64"]) == set()
    assert {"__AVX512F__", "__AVX512BW__"} <= qmatmul.isa_macros("cc", ["-march=x86-64-v4"])  # type: ignore[operator]
    assert qmatmul.isa_macros("cc", ["-march=no-such-isa-anywhere"]) is None


def test_by_default_no_float32_copy_is_kept_and_1_keeps_them(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_parallm_provider.models import private_blas

    _extension()
    if not private_blas.bind_for_gemm():
        pytest.skip("no BLAS bound for the prefill tiles: copies are kept")
    monkeypatch.delenv(small_batch.FLOAT32_ENV, raising=False)
    default = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(default, dequantize=True)
    assert _float32_copies(default) == []  # the packed weights alone, at every batch size
    monkeypatch.setenv(small_batch.FLOAT32_ENV, "1")
    copies = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(copies, dequantize=True)
    assert _float32_copies(copies)


def test_packing_a_layer_copies_none_of_its_packed_bytes(kernel) -> None:
    module = _quantized((2048, 1024), 4, 32)
    mx.eval(module.parameters())
    before = mx.get_active_memory()
    packed = small_batch.PackedWeight.from_module(module).for_kernel(small_batch.qmatmul_ext)
    grown = mx.get_active_memory() - before
    assert packed.packed.nbytes == module.weight.nbytes == 2048 * 512
    # Their float32 upcasts only (the packed bytes, 1 MiB, are the module's), and a little slack:
    # after other tests MLX made ~13 KB of its own small arrays here.
    assert grown <= packed.scales.nbytes + packed.biases.nbytes + 64 * 1024


def test_kernel_rejects_what_it_cannot_read(kernel) -> None:
    assert small_batch.PackedWeight.from_module(_quantized((8, 64), bits=2, group=32)) is None
    packed = small_batch.PackedWeight.from_module(_quantized((8, 64), bits=4, group=32)).for_kernel(kernel)
    with pytest.raises(ValueError, match="unsupported"):
        packed.matmul(kernel, mx.zeros((qmatmul.MAX_ROWS + 1, 64)))


def _quantized_tiny(tiny_model_dir: Path, bits: int = 4):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def test_prepare_model_keeps_packed_weights_and_small_steps_use_them(kernel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    counted = _counting(kernel, calls, monkeypatch)
    model = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(model, dequantize=True)
    kinds = {type(m) for _, m in model.named_modules()}
    assert small_batch.SmallBatchLinear in kinds and small_batch.SmallBatchEmbedding in kinds
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert model.model.layers[0].self_attn.q_proj._source.kernel is counted

    tokens = mx.array([[5], [6]])
    small = model(tokens)  # 2 rows: the kernel
    assert calls and set(calls) == {2}
    calls.clear()
    backends.of(model).packed_rows = 1  # a per-model setting of its backend
    large = model(tokens)  # 2 rows > 1: the GEMM (tiled over the packed weights, or the ctypes kernel's float32 copy)
    assert calls == []
    assert np.allclose(np.asarray(small), np.asarray(large), rtol=1e-4, atol=1e-4)


def test_sibling_layers_share_one_call_and_hold_no_output_past_their_last_member(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = _extension()
    calls: list[int] = []
    model = _quantized_tiny(tiny_model_dir)
    _counting(ext, calls, monkeypatch)
    backend.prepare_model(model, dequantize=True)
    layers = len(model.model.layers)
    mx.eval(model(mx.array([[5], [6]])))  # 2 rows: the packed kernel
    assert len(calls) == layers * 4 + 1  # q/k/v in one call, o, gate/up in one, down; the head
    sources = {id(m._source): m._source for _, m in model.named_modules() if isinstance(m, small_batch.SmallBatchLinear)}
    shared = [s for s in sources.values() if s.members > 1]
    assert len(shared) == 2 * layers
    # Kept to the next step, a prefill's q/k/v and gate/up outputs (every prompt token) held memory for nothing.
    assert all(getattr(s._last, "output", None) is None and getattr(s._last, "input", None) is None for s in shared)


def _float32_copies(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, (small_batch.SmallBatchLinear, small_batch.SmallBatchEmbedding)) and "weight" in m]


def test_with_the_extension_no_float32_copy_is_kept_and_every_path_agrees(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``MLX_PARALLM_FLOAT32_WEIGHTS=0`` the tiled GEMM serves large inputs from the packed
    weights: the model holds no float32 copy, and the kernel, the GEMM, MLX's own ops and the
    embedding lookup all compute what the float32 copy (``=1``) does."""
    _extension()
    reference = _quantized_tiny(tiny_model_dir)
    monkeypatch.setenv(small_batch.FLOAT32_ENV, "1")
    backend.prepare_model(reference, dequantize=True)
    assert _float32_copies(reference)
    monkeypatch.setenv(small_batch.FLOAT32_ENV, "0")
    model = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(model, dequantize=True)
    assert _float32_copies(model) == []
    packed_bytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    assert packed_bytes < sum(p.nbytes for _, p in tree_flatten(reference.parameters())) / 2  # norms only: the packed arrays live in the layers' sources

    tokens = mx.array([[5, 9, 14, 2, 7, 7, 30, 1, 4, 11, 3]])  # 11 rows: the GEMM
    expected = np.asarray(reference(tokens))
    embedded = model.model.embed_tokens(tokens)
    assert np.allclose(np.asarray(embedded), np.asarray(reference.model.embed_tokens(tokens)), rtol=1e-6, atol=1e-6)
    for rows in (backends.of(model).packed_rows, 0):  # 11 rows through the kernel, then through the GEMM
        backends.of(model).packed_rows = rows
        assert np.allclose(np.asarray(model(tokens)), expected, rtol=1e-4, atol=1e-4)
    backends.of(model).packed_rows = 16
    assert np.allclose(np.asarray(model(tokens)), expected, rtol=1e-4, atol=1e-4)
    with backends.using(model, "mlx"):  # MLX's own quantized_matmul on the same packed weights
        assert np.allclose(np.asarray(model(tokens)), expected, rtol=1e-3, atol=1e-3)


def test_the_model_takes_the_extension_where_it_builds(tiny_model_dir: Path) -> None:
    ext = _extension()
    assert small_batch.load_kernel() is ext
    model = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(model, dequantize=True)
    source = model.model.layers[0].mlp.gate_proj._source
    assert source.kernel is ext and isinstance(source.packed.packed, mx.array)


def test_without_a_cxx_compiler_the_model_takes_the_ctypes_kernel(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _ctypes_kernel()
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    qmatmul_ext.reset()
    try:
        assert qmatmul_ext.build() is None and qmatmul_ext.load() is None
        assert small_batch.load_kernel() is lib
        model = _quantized_tiny(tiny_model_dir)
        tokens = mx.array([[5], [6]])
        quantized = model(tokens)
        backend.prepare_model(model, dequantize=True)
        source = model.model.layers[0].self_attn.k_proj._source
        assert source.kernel is lib and isinstance(source.packed.packed, np.ndarray)
        assert mx.allclose(model(tokens), quantized, atol=1e-2, rtol=1e-2)
    finally:
        qmatmul_ext.reset()


def test_a_failing_extension_build_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _ctypes_kernel()
    monkeypatch.setenv("MLX_PARALLM_HOME", str(tmp_path))
    monkeypatch.setattr(qmatmul_ext, "_CXX_FLAGS", [*qmatmul_ext._CXX_FLAGS, "-include", "no/such/header.h"])
    qmatmul_ext.reset()
    try:
        assert qmatmul_ext.load() is None
        assert isinstance(small_batch.load_kernel(), ctypes.CDLL)
        assert not list((tmp_path / "kernels").glob("qmatmul_ext-*"))
    finally:
        qmatmul_ext.reset()


def test_without_a_compiler_the_model_keeps_mlx_ops(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    qmatmul.reset()
    qmatmul_ext.reset()
    try:
        assert qmatmul.build() is None and qmatmul.load() is None and qmatmul_ext.load() is None
        model = _quantized_tiny(tiny_model_dir)
        tokens = mx.array([[5, 6, 7]])
        quantized = model(tokens)
        backend.prepare_model(model, dequantize=True)
        assert not any(isinstance(m, (small_batch.SmallBatchLinear, small_batch.SmallBatchEmbedding)) for _, m in model.named_modules())
        assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
        assert mx.allclose(model(tokens), quantized, atol=1e-2, rtol=1e-2)
    finally:
        qmatmul.reset()
        qmatmul_ext.reset()


# The extension's case (its build takes ~45 s) is checked on the build that test_native_safety.py's
# test_a_truncated_cached_kernel_is_rebuilt_not_loaded[extension-half] makes in a fresh home.
@pytest.mark.parametrize("module", [qmatmul])
def test_build_is_cached_per_source_and_machine(module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_PARALLM_HOME", str(tmp_path))
    first = module.build()
    if first is None:
        pytest.skip(f"{module.__name__} does not build here")
    assert first is not None and first.parent == tmp_path / "kernels"
    stamp = first.stat().st_mtime_ns
    assert module.build() == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, first.name + ".record"]  # the kernel and its size + sha256


def test_engine_greedy_batched_equals_one_at_a_time_on_packed_weights(kernel, tiny_model_dir: Path, make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_parallm_provider.engine import SamplingParams

    calls: list[int] = []
    _counting(kernel, calls, monkeypatch)
    model = _quantized_tiny(tiny_model_dir)
    backend.prepare_model(model, dequantize=True)
    prompts = [[1, 5 + i, 9, 30 + 3 * i] for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = make_engine(model)
    together = engine.generate_many_sync(prompts, params)  # 12 rows: the GEMM, the kernel as rows leave
    alone = [engine.generate_many_sync([p], params)[0] for p in prompts]  # 1 row: the kernel
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert 1 in calls
