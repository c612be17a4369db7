"""The GPU paged-attention kernels against the gather path, and the GPU backend around them.

On a GPU the kernels run through MLX's ``cuda_kernel`` / ``metal_kernel``; elsewhere their
same body text runs on the CPU (``gpu_kernel_emulator``). Random pools: rows of 1 to 4,000
tokens in shuffled blocks, GQA groups of 1 to 8, sliding windows, prefill pieces."""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx
import pytest

from attention_step_helpers import fused_then_apart, prefilled
from conftest import TINY_CONFIG, write_tiny_model
from gpu_kernel_emulator import KernelLoop, cuda_source, nvrtc, nvrtc_compile
from mlx_parallm_provider.config import DeviceConfig
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.models import backends, paged_kernels
from mlx_parallm_provider.models.backends.gpu_kernels import GPUKernels, MLXKernels, check_kernels
from mlx_parallm_provider.models.device import gpu_platform


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory):
    """The kernels as this machine runs them: MLX's custom kernels on a GPU, else the CPU loop."""
    platform = gpu_platform()
    if platform is not None:
        return MLXKernels(platform)
    if not KernelLoop.available():
        pytest.skip("no GPU and no C++ compiler to run the kernels' text on the CPU")
    return KernelLoop(tmp_path_factory.mktemp("kernels"))


def _pool(lengths: list[int], block_size: int, kv_heads: int, D: int, dtype: mx.Dtype, seed: int, spare: int = 5):
    """Pools holding rows of ``lengths`` tokens in shuffled blocks, and the rows' block table."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    counts = [-(-n // block_size) for n in lengths]
    blocks = sum(counts) + spare
    order = mx.random.permutation(blocks, key=k3).tolist()
    width = max(counts)
    table, at = [], 0
    for c in counts:
        table.append(order[at : at + c] + [0] * (width - c))  # a short row's unused entries point anywhere
        at += c
    k_pool = mx.random.normal((blocks * block_size, kv_heads, D), key=k1).astype(dtype)
    v_pool = mx.random.normal((blocks * block_size, kv_heads, D), key=k2).astype(dtype)
    return k_pool, v_pool, mx.array(table, dtype=mx.int32)


CASES = [
    # lengths, heads, kv_heads, D, block, window, dtype
    ([1, 1000, 4000], 8, 2, 64, 16, None, mx.float16),
    ([4000, 17, 256, 1], 8, 8, 32, 32, None, mx.float32),
    ([3, 999, 4000], 16, 2, 64, 16, 512, mx.float16),
    ([50, 7], 8, 1, 128, 8, 16, mx.float32),
    ([3, 999, 4000], 8, 2, 64, 16, 512, mx.bfloat16),
]


@pytest.mark.parametrize("lengths,heads,kv_heads,D,block,window,dtype", CASES)
def test_decode_step_equals_the_gather_path(launch, lengths, heads, kv_heads, D, block, window, dtype) -> None:
    k_pool, v_pool, table = _pool(lengths, block, kv_heads, D, dtype, seed=len(lengths) + D)
    queries = mx.random.normal((len(lengths), heads, 1, D), key=mx.random.key(D))
    limits = mx.array(lengths, dtype=mx.int32)
    got = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, block, D**-0.5, launch, window=window)
    want = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, limits, block, D**-0.5, window=window)
    assert got.shape == want.shape == queries.shape and got.dtype == queries.dtype
    assert mx.abs(got - want).max().item() < 1e-4


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_queries_in_the_models_dtype_are_read_as_their_float32_values(launch, dtype) -> None:
    """The scores kernel reads 16-bit queries itself (no float32 copy of them is made first):
    bit for bit the attention their float32 values give (one split and two)."""
    lengths = [3, 300, 40]
    k_pool, v_pool, table = _pool(lengths, 16, 2, 64, dtype, seed=5)
    queries = mx.random.normal((3, 8, 1, 64), key=mx.random.key(5)).astype(dtype)
    limits = mx.array(lengths, dtype=mx.int32)
    got = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, 16, 0.125, launch)
    want = paged_kernels.paged_attention(queries.astype(mx.float32), k_pool, v_pool, table, limits, 16, 0.125, launch)
    assert got.dtype == dtype and mx.array_equal(got, want.astype(dtype)).item()


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_piece_positions_each_see_their_own_tokens(launch, window: Optional[int]) -> None:
    """A piece of L positions per row (a prefill chunk, a verify step): position j of a row
    holding s tokens before the piece sees s + j + 1; a row's padding repeats its last limit."""
    held, new = [0, 30, 5], [7, 4, 1]
    L = max(new)
    lengths = [s + n for s, n in zip(held, new)]
    k_pool, v_pool, table = _pool(lengths, 4, 2, 32, mx.float32, seed=3)
    limits = mx.array([[s + min(j, n - 1) + 1 for j in range(L)] for s, n in zip(held, new)], dtype=mx.int32)
    queries = mx.random.normal((3, 4, L, 32), key=mx.random.key(9))
    got = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, launch, window=window)
    want = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, window=window)
    assert mx.abs(got - want).max().item() < 1e-4
    # each position really differs from attending over the whole row (the limits are read)
    whole = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, mx.array(lengths, dtype=mx.int32), 4, 0.3)
    assert mx.abs(got[0, :, 0] - whole[0, :, 0]).max().item() > 1e-3


@pytest.mark.parametrize("L,window", [(9, None), (1, None), (9, 6)])
def test_long_pieces_are_attended_in_parts_of_bounded_scores(launch, L: int, window: Optional[int]) -> None:
    """Past ``max_scores`` the positions (then the rows) are attended in parts: each launch's
    scores stay within the bound and the result is the one-launch result."""
    held = [20, 3, 41, 0, 11]
    lengths = [s + L for s in held]
    k_pool, v_pool, table = _pool(lengths, 4, 2, 32, mx.float32, seed=5)
    limits = mx.array([[s + j + 1 for j in range(L)] for s in held], dtype=mx.int32)
    queries = mx.random.normal((len(held), 4, L, 32), key=mx.random.key(4))
    sizes: list[int] = []

    def counted(call):
        if call.kernel is paged_kernels.SCORES:
            sizes.append(call.output_shape[0] * call.output_shape[1] * call.output_shape[2] * call.output_shape[3])
        return launch(call)

    T = table.shape[1] * 4 if not window else window
    bound = 4 * T * 2  # two positions of one row
    got = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, counted, window=window, max_scores=bound)
    whole = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, launch, window=window)
    want = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, window=window)
    assert len(sizes) > 1 and max(sizes) <= bound and sum(sizes) == len(held) * 4 * L * T
    assert mx.abs(got - whole).max().item() < 1e-5 and mx.abs(got - want).max().item() < 1e-4


def test_the_first_use_check_fails_kernels_that_misread_16_bit_queries(launch) -> None:
    """A 16-bit model's queries and pools run kernels compiled for them: the check attends
    float16 and bfloat16 ones too, so a misreading there is caught at first use."""
    import dataclasses

    def misread(call):
        if call.kernel.name == paged_kernels.SCORES.name and call.inputs[0].dtype != mx.float32:
            call = dataclasses.replace(call, inputs=[call.inputs[0] * 0, *call.inputs[1:]])
        return launch(call)

    assert "float16 queries and pools" in check_kernels(misread)


def test_the_first_use_checks_pass_and_the_backend_takes_float_and_quantized_pools(launch) -> None:
    assert check_kernels(launch) is None and check_kernels(launch, quantized=True) is None
    backend = GPUKernels(DeviceConfig(paged_attention="auto"), launch=launch, platform="test")
    k_pool, v_pool, table = _pool([9, 20], 4, 2, 32, mx.float32, seed=1)
    queries = mx.random.normal((2, 4, 1, 32))
    lengths = mx.array([9, 20], dtype=mx.int32)
    out = backend.paged_decode_attention(queries, k_pool, v_pool, table, lengths, 4, 0.25)
    assert out is not None and backend.attention_path() == "paged kernels (test)"
    codes_k, codes_v, scales = paged_kernels.quantize_pools(k_pool, v_pool, 8)
    quantized = backend.paged_decode_attention(queries, codes_k, codes_v, table, lengths, 4, 0.25, scales=scales, bits=8)
    want = paged_kernels.gathered_attention(queries, codes_k, codes_v, table, lengths, 4, 0.25, scales=scales, bits=8)
    assert quantized is not None and mx.abs(quantized - want).max().item() < 1e-4
    assert mx.abs(quantized - out).max().item() < 0.05  # int8 blocks: close to the float pools' attention
    # layouts the kernels do not take: the caller gathers
    assert backend.paged_decode_attention(queries, codes_k, codes_v, table, lengths, 4, 0.25, scales=scales, bits=4) is None  # (8-bit codes)
    assert backend.paged_decode_attention(queries, codes_k, codes_v, table, lengths, 4, 0.25, scales=scales[:3], bits=8) is None
    assert backend.paged_decode_attention(queries[:, :3], k_pool, v_pool, table, lengths, 4, 0.25) is None  # 3 heads over 2 KV heads


def _tf32(x: mx.array) -> mx.array:
    """``x`` in float32 with TF32's 10-bit mantissa (the low 13 bits dropped), as a GPU's
    tensor cores read a float32 matmul's inputs under MLX's default ``MLX_ENABLE_TF32=1``."""
    return mx.view(mx.view(x.astype(mx.float32), mx.uint32) & mx.array(0xFFFFE000, dtype=mx.uint32), mx.float32)


def _tf32_attention(q, k, v, scale, mask=None, sinks=None):
    """MLX's attention as its fallback computes it on a GPU in float32 by default: two
    matmuls, each over inputs rounded to TF32."""
    B, heads, L, D = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scores = _tf32(q * scale).reshape(B, kv_heads, group, L, D) @ _tf32(k)[:, :, None].swapaxes(-1, -2)
    scores = mx.where(mask[:, :, None], scores, -1e30)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.reshape(1, kv_heads, group, 1, 1), (*scores.shape[:-1], 1))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    return (_tf32(probs) @ _tf32(v)[:, :, None]).reshape(B, heads, L, D)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_first_use_check_holds_where_mlxs_float32_matmuls_run_in_tf32(launch, monkeypatch, seed: int) -> None:
    """On a GPU MLX multiplies float32 in TF32 by default, so attention gathered and attended
    by its ops differs from the kernels' float32 by ~2-4e-3 on the check's pool, past its
    tolerance: the check compares with the exact reference instead, and passes; against MLX's
    attention rounded so it would have failed (and the kernels gone unused)."""
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", _tf32_attention)
    assert check_kernels(launch, seed=seed) is None
    rounded = paged_kernels.gathered_attention
    monkeypatch.setattr(paged_kernels, "gathered_attention", lambda *args, exact=False, **kwargs: rounded(*args, **kwargs))
    assert "differs from the gather path" in check_kernels(launch, seed=seed)


@pytest.mark.parametrize("extra", [{}, {"window": 6}, {"softcap": 1.5}, {"bits": 4}, {"sinks": True}])
def test_the_exact_reference_is_the_gather_path_without_matmuls(extra: dict) -> None:
    """``gathered_attention(exact=True)`` (products and sums, no matmul) computes what the
    gather path computes: GQA, prefill positions, a window, a softcap, int4 pools, sinks."""
    k_pool, v_pool, table = _pool([40, 3, 17], 4, 2, 32, mx.float32, seed=41)
    limits = mx.array([[s + j + 1 for j in range(3)] for s in (37, 0, 14)], dtype=mx.int32)
    queries = mx.random.normal((3, 8, 3, 32), key=mx.random.key(42))
    if extra.get("sinks"):
        extra = {"sinks": mx.random.normal((8,), key=mx.random.key(43))}
    if extra.get("bits"):
        k_pool, v_pool, scales = paged_kernels.quantize_pools(k_pool, v_pool, extra["bits"])
        extra = {**extra, "scales": scales}
    args = (queries, k_pool, v_pool, table, limits, 4, 0.3)
    exact = paged_kernels.gathered_attention(*args, **extra, exact=True)
    assert mx.abs(exact - paged_kernels.gathered_attention(*args, **extra)).max().item() < 1e-5


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("lengths,heads,kv_heads,D,block,window,L", [
    ([1, 1000, 4000], 8, 2, 64, 16, None, 1),
    ([3, 999, 400], 16, 2, 64, 16, 512, 1),
    ([50, 7, 33], 8, 1, 128, 8, 16, 3),
])
def test_quantized_pools_are_read_through_the_block_tables_as_the_gather_path_reads_them(
        launch, bits, lengths, heads, kv_heads, D, block, window, L) -> None:
    """int8 / int4 blocks (``mx.quantize``'s packing), decode steps and prefill pieces, GQA,
    windows: the kernels dequantize each value where they use it, as ``mx.dequantize`` does."""
    k_pool, v_pool, table = _pool(lengths, block, kv_heads, D, mx.float32, seed=bits + D)
    codes_k, codes_v, scales = paged_kernels.quantize_pools(k_pool, v_pool, bits)
    queries = mx.random.normal((len(lengths), heads, L, D), key=mx.random.key(D))
    limits = mx.array([[n - L + j + 1 for j in range(L)] for n in lengths], dtype=mx.int32)
    args = (queries, codes_k, codes_v, table, limits, block, D**-0.5)
    got = paged_kernels.paged_attention(*args, launch, window=window, scales=scales, bits=bits)
    want = paged_kernels.gathered_attention(*args, window=window, scales=scales, bits=bits)
    assert got.shape == queries.shape and mx.abs(got - want).max().item() < 1e-4
    floats = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, limits, block, D**-0.5, window=window)
    assert 1e-4 < mx.abs(got - floats).max().item() < (0.05 if bits == 8 else 0.5)  # quantized, and not by much


def _quantized_kernels_broken(launch):
    def run(call: paged_kernels.KernelCall) -> mx.array:
        if call.kernel in (paged_kernels.QUANTIZED_SCORES, paged_kernels.QUANTIZED_VALUES):
            raise RuntimeError("Failed to compile kernel: (a quantized one)")
        return launch(call)
    return run


def test_quantized_kernels_that_fail_their_check_leave_the_float_ones_in_use(launch, caplog) -> None:
    backend = GPUKernels(DeviceConfig(paged_attention="auto"), launch=_quantized_kernels_broken(launch), platform="test")
    k_pool, v_pool, table = _pool([9, 20], 4, 2, 32, mx.float32, seed=1)
    queries, lengths = mx.random.normal((2, 4, 1, 32)), mx.array([9, 20], dtype=mx.int32)
    codes_k, codes_v, scales = paged_kernels.quantize_pools(k_pool, v_pool, 8)
    with caplog.at_level(logging.WARNING):
        assert backend.paged_decode_attention(queries, codes_k, codes_v, table, lengths, 4, 0.25, scales=scales, bits=8) is None
    assert backend.paged_decode_attention(queries, k_pool, v_pool, table, lengths, 4, 0.25) is not None
    assert backend.attention_path().startswith("paged kernels (test); quantized KV gathered (its kernels failed their check:")
    assert len([r for r in caplog.records if "quantized-KV paged attention kernels unusable" in r.getMessage()]) == 1
    strict = GPUKernels(DeviceConfig(paged_attention="kernel"), launch=_quantized_kernels_broken(launch), platform="test")
    with pytest.raises(RuntimeError, match="quantized-KV paged attention kernels failed their check"):
        strict.paged_decode_attention(queries, codes_k, codes_v, table, lengths, 4, 0.25, scales=scales, bits=8)


def _wrong(call: paged_kernels.KernelCall) -> mx.array:
    return mx.zeros(call.output_shape)


def _broken(call: paged_kernels.KernelCall) -> mx.array:
    raise RuntimeError("nvrtc: error: identifier 'idx_t' is undefined")


@pytest.mark.parametrize("bad", [_wrong, _broken])
def test_kernels_that_fail_their_check_fall_back_to_the_gather_path_or_raise(bad, caplog) -> None:
    k_pool, v_pool, table = _pool([9, 20], 4, 2, 16, mx.float32, seed=1)
    queries, lengths = mx.random.normal((2, 4, 1, 16)), mx.array([9, 20], dtype=mx.int32)
    auto = GPUKernels(DeviceConfig(paged_attention="auto"), launch=bad, platform="test")
    with caplog.at_level(logging.WARNING):
        assert auto.paged_decode_attention(queries, k_pool, v_pool, table, lengths, 4, 0.25) is None
        assert auto.paged_decode_attention(queries, k_pool, v_pool, table, lengths, 4, 0.25) is None
    assert len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1  # checked and warned once
    assert auto.attention_path().startswith("gather (the paged kernels failed their check:")
    strict = GPUKernels(DeviceConfig(paged_attention="kernel"), launch=bad, platform="test")
    with pytest.raises(RuntimeError, match="failed their check"):
        strict.paged_decode_attention(queries, k_pool, v_pool, table, lengths, 4, 0.25)


def test_an_engine_whose_kernels_fail_their_check_gathers_and_its_stats_say_why(tiny_model, make_engine) -> None:
    prompts, params = [[1, 5, 9, 30], [1, 6, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with backends.using(tiny_model.model, "mlx"):
        gathered = [o.token_ids for o in make_engine(kv_block_size=4).generate_many_sync(prompts, params)]
    with backends.using(tiny_model.model, GPUKernels(DeviceConfig(), launch=_wrong, platform="test")):
        engine = make_engine(kv_block_size=4)
        assert [o.token_ids for o in engine.generate_many_sync(prompts, params)] == gathered
        stats = engine.stats()
    assert stats["backend"] == "gpu"
    assert stats["attention"].startswith("gather (the paged kernels failed their check: differs from the gather path by ")


def test_gather_setting_never_runs_the_kernels() -> None:
    def launch(call):
        raise AssertionError("a kernel ran")

    backend = GPUKernels(DeviceConfig(paged_attention="gather"), launch=launch, platform="test")
    k_pool, v_pool, table = _pool([9], 4, 2, 16, mx.float32, seed=1)
    assert backend.paged_decode_attention(mx.zeros((1, 4, 1, 16)), k_pool, v_pool, table, mx.array([9]), 4, 0.25) is None
    assert backend.attention_path() == "gather (paged_attention='gather')"


@pytest.mark.parametrize("window", [None, 8])
def test_engine_on_the_gpu_kernels_answers_as_the_gather_path_and_alone(tiny_model, make_engine, launch, window) -> None:
    """Greedy, batched: the engine attending through the kernels equals MLX's ops gathering,
    and each prompt alone; every step (prefill pieces and decode) went through the kernels.
    ``window``: every layer sliding (``max_kv_size``)."""
    prompts = [[1, 5 + i, 9, 30 + 3 * i, 7, 11, 200 + i, 40, 41, 42, 43][: 3 + 2 * i] for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    calls: list[str] = []

    def counted(call):
        calls.append(call.kernel.name)
        return launch(call)

    with backends.using(tiny_model.model, "mlx"):
        engine = make_engine(kv_block_size=4, max_kv_size=window)
        gathered = [o.token_ids for o in engine.generate_many_sync(prompts, params)]
        assert (engine.stats()["backend"], engine.stats()["attention"]) == ("mlx", "gather (MLX's ops)")
    with backends.using(tiny_model.model, GPUKernels(DeviceConfig(), launch=counted, platform="test")):
        engine = make_engine(kv_block_size=4, max_kv_size=window)
        assert engine.stats()["attention"] == "paged kernels (test), checked at first use"
        together = [o.token_ids for o in engine.generate_many_sync(prompts, params)]
        alone = [engine.generate_many_sync([p], params)[0].token_ids for p in prompts]
        assert (engine.stats()["backend"], engine.stats()["attention"]) == ("gpu", "paged kernels (test)")
    assert together == gathered == alone
    layers = len(tiny_model.model.layers)
    assert calls.count("parallm_paged_scores") >= layers * params.max_tokens  # every layer of every step


@pytest.fixture(scope="module")
def gpu_model(tiny_model_dir, launch):
    """A fresh tiny llama on the GPU backend, its kernels run by ``launch``."""
    from mlx_parallm_provider.models import registry

    loaded = registry._load_uncached(str(tiny_model_dir), None)
    backends.install(loaded.model, GPUKernels(DeviceConfig(), launch=launch, platform="test"))
    return loaded


@pytest.fixture
def gpu_steps(gpu_model, monkeypatch) -> list[int]:
    """Grows by one at each of the GPU backend's attention steps."""
    backend = backends.of(gpu_model.model)
    steps: list[int] = []
    step = backend.paged_attention_step

    def counted(*args, **kwargs):
        steps.append(1)
        return step(*args, **kwargs)

    monkeypatch.setattr(backend, "paged_attention_step", counted)
    return steps


def _gpu_steps_off(gpu_model, monkeypatch) -> None:
    monkeypatch.setattr(backends.of(gpu_model.model), "steps_attention", lambda rope: False)


@pytest.mark.parametrize("dtype", [None, mx.float16, mx.bfloat16], ids=["float32-pools", "float16-pools", "bfloat16-pools"])
@pytest.mark.parametrize("width", [1, 3, 24], ids=["decode", "verify", "prefill"])
def test_the_gpu_attention_step_gives_the_logits_and_kv_of_mlx_lms_attention(gpu_model, gpu_steps, monkeypatch, dtype, width) -> None:
    """The GPU backend's attention step (fewer ops: reshapes, RoPE, the K/V scattered into the
    pools, the kernels) against mlx-lm's attention code over the same cache and kernels: the
    same logits and the same KV written, bit for bit."""
    layers = len(gpu_model.model.layers)

    def turn_off() -> None:
        assert len(gpu_steps) == layers
        _gpu_steps_off(gpu_model, monkeypatch)

    fused_then_apart(gpu_model.model, dtype, width, turn_off)
    assert len(gpu_steps) == layers  # (mlx-lm's code ran the second step)


def test_the_gpu_attention_step_builds_fewer_ops_than_mlx_lms_attention(gpu_model, gpu_steps, monkeypatch) -> None:
    """A decode step's graph through the step against through mlx-lm's attention code (the
    host builds each op; a GPU launches most): at least 6 fewer a layer. (The kernels are
    stood for by an op of their inputs: run on the CPU, they would evaluate the graph.)"""
    from mlx_parallm_provider.bench.gpu import graph_nodes
    from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch

    model = gpu_model.model
    prompts = [list(range(7, 7 + n)) for n in (3, 17, 40)]
    kv, storage = prefilled(model, prompts, 4, mx.bfloat16)  # (the kernels checked and used)
    monkeypatch.setattr(backends.of(model), "_launch",
                        lambda call: mx.depends([mx.zeros(call.output_shape, mx.float32)], list(call.inputs))[0])

    def ops() -> int:
        batch = PagedBatch(storage, [kv.table(b) for b in range(3)], [len(p) for p in prompts], [1, 1, 1], 1)
        nodes = graph_nodes(model(mx.array([[11], [12], [13]]), cache=batch.layers()))
        mx.eval(storage.arrays())  # (else the next step's graph holds this one's writes)
        return nodes

    stepped = ops()
    assert len(gpu_steps) == len(model.layers)
    _gpu_steps_off(gpu_model, monkeypatch)
    assert ops() >= stepped + 6 * len(model.layers)  # (7 here: 6 transposes, a reshape)


def test_the_gpu_attention_step_is_not_taken_where_its_kernels_are_not(gpu_model, gpu_steps) -> None:
    """Quantized pools (their kernels are reached through mlx-lm's code), and query heads that
    are no whole group of each KV head: mlx-lm's code runs, and gathers where it must."""
    backend = backends.of(gpu_model.model)
    pool = mx.zeros((16, 2, 32))
    assert backend.fits_attention_step(4, pool, None, 0) and backend.fits_attention_step(2, pool.astype(mx.bfloat16), None, 0)
    assert not backend.fits_attention_step(3, pool, None, 0)
    assert not backend.fits_attention_step(4, mx.zeros((16, 2, 8), mx.uint32), [mx.zeros((16, 2, 1), mx.float16)] * 4, 8)
    gather = GPUKernels(DeviceConfig(paged_attention="gather"), launch=lambda call: None, platform="test")
    assert not gather.steps_attention(None)


def test_an_engine_on_the_gpu_backend_decodes_the_same_tokens_with_its_attention_step_and_without(
        gpu_model, gpu_steps, make_engine, monkeypatch) -> None:
    """Greedy, batched, with n-gram drafts verified: the same tokens through the GPU backend's
    attention step as through mlx-lm's attention code."""
    prompts = [[1, 5, 9, 14, 2, 5, 9, 14, 2, 5][: 4 + i] for i in range(5)]  # repeats: n-gram drafts get verified
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        engine = make_engine(gpu_model.model, kv_block_size=4, speculative="ngram")
        return [o.token_ids for o in engine.generate_many_sync(prompts, params)]

    stepped = tokens()
    ran = len(gpu_steps)
    assert ran >= len(gpu_model.model.layers) * params.max_tokens // 2  # decode and verify steps took it
    _gpu_steps_off(gpu_model, monkeypatch)
    assert tokens() == stepped
    assert len(gpu_steps) == ran


@pytest.mark.parametrize("L,window,dtype", [(1, None, mx.float16), (1, 6, mx.float32), (5, None, mx.float32), (5, 6, mx.float16)])
def test_attention_sinks_take_their_share_as_the_gather_path_gives_it(launch, L: int, window: Optional[int], dtype) -> None:
    """gpt-oss's per-head sinks: the kernels' softmax with one more logit per head equals MLX's
    attention with ``sinks=`` over the gathered blocks (decode steps and prefill pieces, GQA,
    windows), and differs from attention without them."""
    held = [40, 3, 17]
    lengths = [s + L for s in held]
    k_pool, v_pool, table = _pool(lengths, 4, 2, 32, dtype, seed=11 + L)
    limits = mx.array([[s + j + 1 for j in range(L)] for s in held], dtype=mx.int32)
    queries = mx.random.normal((3, 8, L, 32), key=mx.random.key(12)).astype(dtype)
    sinks = mx.array([2.0, -1.0, 0.5, 3.0, 0.0, -4.0, 1.0, 6.0]).astype(dtype)
    got = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, launch, window=window, sinks=sinks)
    want = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, window=window, sinks=sinks)
    plain = paged_kernels.gathered_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, window=window)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2  # (outputs rounded to 16 bits)
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tolerance
    assert mx.abs(got.astype(mx.float32) - plain.astype(mx.float32)).max().item() > 0.05
    # in parts of bounded scores too
    parts = paged_kernels.paged_attention(queries, k_pool, v_pool, table, limits, 4, 0.3, launch, window=window, sinks=sinks,
                                          max_scores=8 * 48)
    assert mx.abs(parts.astype(mx.float32) - got.astype(mx.float32)).max().item() < 1e-5 + (0 if dtype == mx.float32 else 1e-2)


@pytest.mark.parametrize("L,window,dtype", [(1, None, mx.float16), (1, 6, mx.float32), (5, None, mx.float32), (5, 6, mx.float16)])
def test_a_softcap_caps_the_scores_as_gemma2_caps_them(launch, L: int, window: Optional[int], dtype) -> None:
    """gemma2's ``softcap * tanh(score / softcap)`` between the kernels equals the same
    attention written out here in numpy over each row's tokens (decode steps and prefill
    pieces, GQA, windows), equals the gather path's, and differs from attention without it."""
    import numpy as np

    held, heads, kv_heads, D, block, cap, scale = [40, 3, 17], 8, 2, 32, 4, 1.5, 0.3
    lengths = [s + L for s in held]
    k_pool, v_pool, table = _pool(lengths, block, kv_heads, D, dtype, seed=21 + L)
    limits = mx.array([[s + j + 1 for j in range(L)] for s in held], dtype=mx.int32)
    queries = mx.random.normal((3, heads, L, D), key=mx.random.key(22)).astype(dtype)
    args = (queries, k_pool, v_pool, table, limits, block, scale)
    got = paged_kernels.paged_attention(*args, launch, window=window, softcap=cap).astype(mx.float32)
    q, k, v = (np.array(a.astype(mx.float32)) for a in (queries, k_pool, v_pool))
    want = np.zeros(got.shape, dtype=np.float32)
    for b in range(3):
        slots = [table[b, t // block].item() * block + t % block for t in range(lengths[b])]
        for j in range(L):
            end = held[b] + j + 1
            seen = slots[max(0, end - window) if window else 0 : end]
            for h in range(heads):
                g = h // (heads // kv_heads)
                scores = cap * np.tanh(k[seen, g] @ q[b, h, j] * scale / cap)
                p = np.exp(scores - scores.max())
                want[b, h, j] = (p / p.sum()) @ v[seen, g]
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2  # (outputs rounded to 16 bits)
    assert np.abs(np.array(got) - want).max() < tolerance
    gathered = paged_kernels.gathered_attention(*args, window=window, softcap=cap).astype(mx.float32)
    assert mx.abs(got - gathered).max().item() < tolerance
    plain = paged_kernels.paged_attention(*args, launch, window=window).astype(mx.float32)
    assert mx.abs(got - plain).max().item() > 0.05
    parts = paged_kernels.paged_attention(*args, launch, window=window, softcap=cap, max_scores=8 * 48)  # in parts of bounded scores
    assert mx.abs(parts.astype(mx.float32) - got).max().item() < 1e-5 + (0 if dtype == mx.float32 else 1e-2)


@pytest.mark.parametrize("heads,kv_heads,L,window", [(48, 1, 1, None), (40, 2, 3, 6), (71, 1, 1, 5)])
def test_groups_of_more_query_heads_than_a_thread_holds_are_attended_in_parts(launch, heads, kv_heads, L, window) -> None:
    """More than MAX_GROUP query heads per KV head (multi-query models: 48 or 71 heads on one KV
    head): the group is attended in parts, each head as the gather path attends it, sinks
    and a softcap per head included."""
    held = [40, 3, 17]
    k_pool, v_pool, table = _pool([s + L for s in held], 4, kv_heads, 32, mx.float32, seed=31 + heads)
    limits = mx.array([[s + j + 1 for j in range(L)] for s in held], dtype=mx.int32)
    queries = mx.random.normal((3, heads, L, 32), key=mx.random.key(32))
    sinks = mx.random.normal((heads,), key=mx.random.key(33))
    assert heads // kv_heads > paged_kernels.MAX_GROUP and paged_kernels.takes(queries, k_pool, v_pool, limits)
    args = (queries, k_pool, v_pool, table, limits, 4, 0.3)
    for extra in ({}, {"sinks": sinks}, {"softcap": 1.5}):
        got = paged_kernels.paged_attention(*args, launch, window=window, **extra)
        want = paged_kernels.gathered_attention(*args, window=window, **extra)
        assert mx.abs(got - want).max().item() < 1e-4, extra


GPT_OSS = {  # attention sinks, YaRN, 4 experts; layer 0 slides (a window of 8), layer 1 is global
    "model_type": "gpt_oss", "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
    "sliding_window": 8, "rope_theta": 150000, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
}
"""gpt-oss's own settings over the tiny llama's sizes (as the architecture matrix builds it)."""


PROMPTS = [[1, 5 + i, 9, 30 + 3 * i, 7, 11, 200 + i, 40, 41, 42, 43, 44, 45][: 4 + 3 * i] for i in range(4)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _kernels_against_gathering(config: dict, tokenizer_dir, folder, launch, params: SamplingParams = GREEDY,
                               read=lambda output: output.token_ids, **engine_config) -> tuple[list, list, list, list[str]]:
    """A random model of ``config`` answering :data:`PROMPTS` (``params``: greedily), on an
    engine of ``engine_config`` (4-token blocks): batched through MLX's ops gathering, then
    batched and each alone through the GPU kernels (run by ``launch``), what ``read`` takes
    of each answer (its token ids); the kernels launched."""
    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine
    from mlx_parallm_provider.models import registry

    loaded = registry.load(str(write_tiny_model(folder, tokenizer_dir, config=config)))
    calls: list[str] = []

    def counted(call):
        calls.append(call.kernel.name)
        return launch(call)

    def run(backend, alone: bool) -> tuple[list[list[int]], list[list[int]]]:
        with backends.using(loaded.model, backend):
            engine = Engine("random", EngineConfig(kv_block_size=4, **engine_config), loaded=loaded)
            try:
                together = [read(o) for o in engine.generate_many_sync(PROMPTS, params)]
                each = [read(engine.generate_many_sync([p], params)[0]) for p in PROMPTS] if alone else []
            finally:
                engine.shutdown()
        return together, each

    gathered, _ = run("mlx", alone=False)
    together, alone = run(GPUKernels(DeviceConfig(), launch=counted, platform="test"), alone=True)
    return gathered, together, alone, calls


def test_gpt_oss_on_the_gpu_kernels_answers_as_the_gather_path_with_its_sinks(launch, smollm_tokenizer_dir, tmp_path) -> None:
    """A tiny gpt-oss (sinks in every layer, a sliding layer and a global one): greedy,
    batched, through the kernels equals MLX's ops gathering, and each prompt alone; its
    attention went through the kernels in both layers."""
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "bos_token_id", "eos_token_id")
    config = {**{k: TINY_CONFIG[k] for k in sizes}, **GPT_OSS}
    gathered, together, alone, calls = _kernels_against_gathering(config, smollm_tokenizer_dir, tmp_path / "gpt-oss", launch)
    assert together == gathered == alone
    assert calls.count(paged_kernels.SCORES.name) >= 2 * GREEDY.max_tokens  # both layers, every step, sinks and all


GEMMA2 = {"model_type": "gemma2", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "query_pre_attn_scalar": 16,
          "attn_logit_softcapping": 0.5, "final_logit_softcapping": 30.0}
"""gemma2's own settings over the tiny llama's sizes, its scores capped hard (at 0.5)."""


def test_gemma2_on_the_gpu_kernels_answers_as_the_gather_path_with_its_softcap(launch, smollm_tokenizer_dir, tmp_path) -> None:
    """A tiny gemma2 (its attention computes softcapped scores itself; routed, it hands the
    cap to the blocks' attend()): greedy, batched, prefill pieces and decode steps through the
    kernels equal MLX's ops over the gathered blocks, and each prompt alone, in every layer;
    the answers' logprobs differ from the same model's with a cap that changes nothing."""
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "bos_token_id", "eos_token_id", "intermediate_size")
    config = {**{k: TINY_CONFIG[k] for k in sizes}, **GEMMA2}
    gathered, together, alone, calls = _kernels_against_gathering(config, smollm_tokenizer_dir, tmp_path / "gemma2", launch,
                                                                  prefill_chunk_size=4)
    assert together == gathered == alone
    assert calls.count(paged_kernels.SCORES.name) >= 2 * GREEDY.max_tokens  # both layers, every step
    logprobs = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True)

    def read(output) -> list[float]:
        return [round(t.logprob, 4) for t in output.logprobs]

    capped = _kernels_against_gathering(config, smollm_tokenizer_dir, tmp_path / "gemma2", launch, logprobs, read)
    uncapped = _kernels_against_gathering({**config, "attn_logit_softcapping": 1e6}, smollm_tokenizer_dir, tmp_path / "uncapped",
                                          launch, logprobs, read)
    assert uncapped[1] != capped[1]  # through the kernels
    assert uncapped[0] != capped[0]  # gathered


STEPPED = {
    "qwen2": {**TINY_CONFIG, "model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "llama3_rope": {**TINY_CONFIG, "max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}},
}
"""Models whose attention the GPU backend's step takes besides the tiny llama: q/k/v with
biases (qwen2), a RoPE of scaled frequencies (Llama 3's)."""


@pytest.mark.parametrize("name", sorted(STEPPED))
def test_models_through_the_gpu_attention_step_answer_as_the_gather_path(launch, smollm_tokenizer_dir, tmp_path, monkeypatch,
                                                                        name: str) -> None:
    """Greedy, batched, prefill pieces and decode steps through the GPU backend's attention
    step equal mlx-lm's attention over the gathered blocks, and each prompt alone."""
    steps: list[int] = []
    step = GPUKernels.paged_attention_step

    def counted(self, *args, **kwargs):
        steps.append(1)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(GPUKernels, "paged_attention_step", counted)
    gathered, together, alone, calls = _kernels_against_gathering(STEPPED[name], smollm_tokenizer_dir, tmp_path / name, launch,
                                                                  prefill_chunk_size=4)
    assert together == gathered == alone
    assert len(steps) >= 2 * GREEDY.max_tokens and calls.count(paged_kernels.SCORES.name) >= len(steps)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_engine_with_quantized_kv_on_the_gpu_kernels_answers_as_the_gather_path(launch, smollm_tokenizer_dir, tmp_path,
                                                                                kv_cache_dtype) -> None:
    """Quantized KV blocks (a head of 32 channels: one quantization group): greedy, batched,
    prefill pieces and decode steps through the quantized kernels equal MLX's ops gathering
    and dequantizing, and each prompt alone."""
    from mlx_parallm_provider.engine.kv.storage import KV_QUANT_GROUP_SIZE

    assert paged_kernels.QUANTIZED_GROUP == KV_QUANT_GROUP_SIZE  # the check's and the benchmark's pools are the storage's
    gathered, together, alone, calls = _kernels_against_gathering(
        {**TINY_CONFIG, "head_dim": 32}, smollm_tokenizer_dir, tmp_path / "d32", launch, kv_cache_dtype=kv_cache_dtype,
        prefill_chunk_size=4)
    assert together == gathered == alone
    assert calls.count(paged_kernels.QUANTIZED_SCORES.name) >= 2 * GREEDY.max_tokens  # both layers, every step


PAIRS = [(paged_kernels.SCORES, [None, None, mx.int32, mx.int32, mx.int32, mx.float32]),  # (queries in the model's dtype)
         (paged_kernels.VALUES, [mx.float32, None, mx.int32, mx.int32, mx.int32])]
QUANTIZED_PAIRS = [(paged_kernels.QUANTIZED_SCORES, [None, mx.uint32, None, None, mx.int32, mx.int32, mx.int32, mx.float32]),
                   (paged_kernels.QUANTIZED_VALUES, [mx.float32, mx.uint32, None, None, mx.int32, mx.int32, mx.int32])]


@pytest.mark.skipif(nvrtc() is None, reason="NVRTC not installed (nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12)")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_cuda_source_compiles_for_sm90(dtype) -> None:
    """The kernels exactly as MLX's ``cuda_kernel`` wraps them, compiled by NVRTC for the H200's
    sm_90: queries and float pools of ``dtype``, and int8 / int4 pools with ``dtype`` scales."""
    layout = paged_kernels.Layout(32, 8, 128, 16, 0, dtype)
    for kernel, types in PAIRS:
        source = cuda_source(kernel, layout, [dtype if t is None else t for t in types])
        compiled, log, ptx = nvrtc_compile(source)
        assert compiled and ptx > 0, log
    for bits in paged_kernels.QUANTIZED_BITS:
        layout = paged_kernels.Layout(32, 8, 128, 16, 0, mx.uint32, bits, 32, dtype)
        for kernel, types in QUANTIZED_PAIRS:
            source = cuda_source(kernel, layout, [dtype if t is None else t for t in types])
            compiled, log, ptx = nvrtc_compile(source)
            assert compiled and ptx > 0, log


def test_doctor_names_the_backend_and_its_paged_attention_path(monkeypatch, launch) -> None:
    from mlx_parallm_provider import doctor

    lines = doctor.report()
    assert lines["device"].startswith(str(mx.default_device()))
    chosen = backends.choose()
    assert lines["backend"] == f"{chosen.name} ({type(chosen).__name__})"
    monkeypatch.setattr(backends, "choose", lambda choice=None, device=None: GPUKernels(device, launch=launch, platform="test"))
    assert doctor.report()["paged attention"] == "paged kernels (test)"  # compiled and checked by doctor itself
    monkeypatch.setattr(backends, "choose", lambda choice=None, device=None: GPUKernels(device, launch=_wrong, platform="test"))
    assert doctor.report()["paged attention"].startswith("gather (the paged kernels failed their check: differs from the gather path")
    monkeypatch.setattr(backends, "choose", lambda choice=None, device=None: backends.MLXOps())
    assert doctor.report()["paged attention"] == "gather (MLX's ops)"
