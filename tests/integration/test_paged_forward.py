"""A forward pass over paged KV gives what mlx-lm's own single-sequence cache gives."""

from __future__ import annotations

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from engine_helpers import PagedPieces, paged_kernel_calls
from mlx_parallm_provider.engine.kv import KVCacheManager, paged_cache
from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch
from mlx_parallm_provider.engine.kv.storage import PagedKVStorage
from mlx_parallm_provider.models import backends


def _reference_logits(model, tokens: list[int]) -> mx.array:
    """Each position's logits, one token at a time through mlx-lm's KVCache."""
    cache = [KVCache() for _ in model.layers]
    return mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens])


@pytest.fixture(params=["kernels", "gather"])
def cpu_ops(request, monkeypatch, tiny_model):
    """Decode steps through the paged CPU kernel (the model's own backend), or (forced: MLX's
    ops as its backend) the gather path every device without one takes; yields the kernel's
    results, to check which path ran."""
    results = paged_kernel_calls(monkeypatch)
    model = tiny_model.model
    with backends.using(model, backends.of(model) if request.param == "kernels" else "mlx"):
        yield request.param, results


@pytest.mark.parametrize("tile_scores", [paged_cache.TILE_SCORES, 1], ids=["untiled", "one-query-tiles"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_prefill_chunks_and_decode_match_mlx_lm(tiny_model, block_size, cpu_ops, tile_scores, monkeypatch):
    monkeypatch.setattr(paged_cache, "TILE_SCORES", tile_scores)  # 1: prefill attends one query at a time
    model = tiny_model.model
    assert backends.routes_attention(model)
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 40)]  # lengths spread over buckets
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    passes = PagedPieces(model, prompts, kv, PagedKVStorage(len(model.layers), kv.pool.num_blocks, block_size))
    passes.run([0, 1, 2], 7)  # right-padded prefill, row 0 ends inside it (narrow: through the block tables)
    passes.run([1, 2], 5)  # chunks continue where each row stands
    passes.run([2], 20)  # a wide piece (through the block tables too, where the backend has the kernel)
    passes.decode_to_the_end()  # one token a row, like decode
    for b, prompt in enumerate(prompts):
        ours = mx.concatenate(passes.got[b])
        assert mx.allclose(ours, _reference_logits(model, prompt), atol=1e-4).item(), b
    mode, kernel_results = cpu_ops
    ran = [r is not None for r in kernel_results]
    if mode == "kernels" and backends.of(model).kernels and _has_extension():
        assert ran and all(ran)
    else:
        assert not any(ran)  # MLX's ops as the backend never ask the kernel


def _has_extension() -> bool:
    from mlx_parallm_provider.models import qmatmul_ext

    ext = qmatmul_ext.load()
    return ext is not None and hasattr(ext, "paged_decode_attention")


def test_storage_grows_on_demand_and_keeps_what_it_held(tiny_model):
    storage = PagedKVStorage(1, num_blocks=100, block_size=2)
    storage.reserve(3)
    assert storage.physical_blocks == 16
    k = mx.arange(2 * 4 * 8, dtype=mx.float32).reshape(2, 4, 8)
    storage.write(0, mx.array([2, 3]), k, k + 1)
    storage.reserve(40)
    assert storage.physical_blocks == 40 and storage.keys[0].shape[0] == 80
    storage.reserve(41)  # by a quarter at least: growing copies every block held
    assert storage.physical_blocks == 50 and storage.keys[0].shape[0] == 100
    storage.reserve(1000)
    assert storage.physical_blocks == 100  # never past the pool
    keys, values = storage.read(0, mx.array([2, 3]))
    assert mx.array_equal(keys, k).item() and mx.array_equal(values, k + 1).item()


def test_float16_storage_holds_halves_and_reads_back_in_the_models_dtype(tiny_model):
    storage = PagedKVStorage(1, num_blocks=8, block_size=2, preallocate=True, dtype=mx.float16)
    k = mx.random.normal((3, 4, 8), key=mx.random.key(0))
    storage.write(0, mx.array([5, 1, 2]), k, -k)
    keys, values = storage.read(0, mx.array([5, 1, 2]))
    assert storage.keys[0].dtype == storage.values[0].dtype == mx.float16
    assert storage.nbytes == 2 * 16 * 4 * 8 * 2  # K and V, 16 slots of 4 x 8 halves
    assert keys.dtype == values.dtype == mx.float32
    assert mx.array_equal(keys, k.astype(mx.float16).astype(mx.float32)).item() and mx.array_equal(values, -keys).item()


def test_storage_grows_ahead_no_further_than_the_cap_but_a_sixteenth_at_least(tiny_model):
    storage = PagedKVStorage(1, num_blocks=1000, block_size=2)
    storage.reserve(160)
    assert storage.physical_blocks == 160
    storage.reserve(161, cap=170)  # a quarter would be 200: the present requests use 170 at most
    assert storage.physical_blocks == 170
    storage.reserve(171, cap=171)  # a sixteenth at least, so a slowly rising peak copies seldom
    assert storage.physical_blocks == 170 + 170 // 16
    storage.reserve(181, cap=5000)  # a large cap: a quarter, as without one
    assert storage.physical_blocks == 180 + 180 // 4
    storage.reserve(226, cap=100)  # a cap below what is asked for: a sixteenth
    assert storage.physical_blocks == 225 + 225 // 16


@pytest.fixture(scope="module")
def tiny_gemma3():
    """A random-weight gemma3 text model whose local layers see 8 tokens (every 3rd layer global)."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(3)
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                                 num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=256,
                                 query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3)
    model = gemma3_text.Model(args)
    model.update(tree_map(lambda p: p * 8, model.parameters()))  # larger weights: windows change the logits visibly
    mx.eval(model.parameters())
    return model


@pytest.fixture(params=["kernels", "gather"])
def gemma3_ops(request, tiny_gemma3):
    """The tiny gemma3 on the backend the engine would choose, or (forced) on MLX's ops."""
    with backends.using(tiny_gemma3, None if request.param == "kernels" else "mlx"):
        yield request.param


def test_sliding_window_layers_on_blocks_match_mlx_lms_rotating_cache(tiny_gemma3, gemma3_ops):
    from mlx_parallm_provider.engine.kv.support import layer_windows

    model = tiny_gemma3
    assert backends.routes_attention(model)
    assert layer_windows(model) == [8, 8, None]
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 40)]
    kv = KVCacheManager(num_blocks=64, block_size=4)
    passes = PagedPieces(model, prompts, kv, PagedKVStorage(len(model.layers), kv.pool.num_blocks, 4), layer_windows(model))
    passes.run([0, 1, 2], 7)
    passes.run([1, 2], 13)  # a chunk wider than the window
    passes.decode_to_the_end()
    for b, prompt in enumerate(prompts):
        cache = model.make_cache()  # mlx-lm's own: RotatingKVCache(8) for the local layers
        reference = mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in prompt])
        ours = mx.concatenate(passes.got[b])
        error = mx.abs(ours - reference).max().item()
        assert error <= 1e-4 * mx.abs(reference).max().item(), (b, error)  # float32 rounding (logits ~100)


def test_a_sliding_window_layer_on_blocks_attends_to_its_window_only(tiny_gemma3, gemma3_ops):
    """One local layer's attention output, chunked over blocks, equals mlx-lm's with its
    RotatingKVCache and differs from attending to every token (the logits above barely
    show the window: this random model's residual stream drowns its attention)."""
    from mlx_lm.models.cache import RotatingKVCache

    attn = tiny_gemma3.model.layers[0].self_attn
    assert backends.routes_attention(tiny_gemma3)
    mx.random.seed(5)
    xs = [mx.random.normal((1, n, 64)) for n in (3, 11, 40)]
    kv = KVCacheManager(num_blocks=64, block_size=4)
    storage = PagedKVStorage(1, kv.pool.num_blocks, 4)
    done, got = [0, 0, 0], [[], [], []]
    for rows, width in [([0, 1, 2], 7), ([1, 2], 13)] + [([1, 2], 1)] * 4 + [([2], 1)] * 25:
        rows = [b for b in rows if done[b] < xs[b].shape[1]]
        if not rows:
            continue
        pieces = [xs[b][:, done[b] : done[b] + width] for b in rows]
        for b, piece in zip(rows, pieces):
            kv.grow(b, done[b] + piece.shape[1])
        storage.reserve(kv.pool.high_water())
        lengths = [p.shape[1] for p in pieces]
        batch = PagedBatch(storage, [kv.table(b) for b in rows], [done[b] for b in rows], lengths, width, [8])
        x = mx.concatenate([mx.pad(p, [(0, 0), (0, width - p.shape[1]), (0, 0)]) for p in pieces])
        out = attn(x, None, batch.layers()[0])
        for i, (b, n) in enumerate(zip(rows, lengths)):
            got[b].append(out[i, :n])
            done[b] += n
    for b, x in enumerate(xs):
        ours = mx.concatenate(got[b])
        windowed, full = RotatingKVCache(max_size=8), KVCache()
        reference = mx.concatenate([attn(x[:, t : t + 1], None, windowed)[0] for t in range(x.shape[1])])
        everything = mx.concatenate([attn(x[:, t : t + 1], None, full)[0] for t in range(x.shape[1])])
        error = mx.abs(ours - reference).max().item()
        assert error <= 2e-5 * mx.abs(reference).max().item(), (b, error)  # float32 rounding (outputs ~50)
        if x.shape[1] > 8:
            assert mx.abs(everything - reference).max().item() > 0.1  # the window matters here


def test_a_gathered_batch_hands_a_model_every_rows_keys_in_order_with_their_mask(tiny_model):
    """For a model that attends itself (gemma2), update_and_fetch returns each row's keys and
    values gathered from its blocks, padded to the longest row, and make_mask which of them
    each query sees (its own earlier tokens; the window's where the layer has one)."""
    kv = KVCacheManager(num_blocks=16, block_size=2)
    storage = PagedKVStorage(1, num_blocks=16, block_size=2, preallocate=True)
    kv.grow("a", 3)
    kv.grow("b", 5)
    tables = [kv.table("a"), kv.table("b")]
    for gathered, window in ((True, None), (True, 2), (False, None)):
        batch = PagedBatch(storage, tables, [0, 0], [3, 5], 5, windows=[window], gathered=gathered)
        layer = batch.layers()[0]
        k = mx.arange(2 * 5 * 4, dtype=mx.float32).reshape(2, 1, 5, 4)  # (B, kv_heads, L, D)
        keys, values = layer.update_and_fetch(k, k + 1)
        mask = layer.make_mask(5)
        if not gathered:
            assert keys is k and mask is None
            continue
        assert keys.shape == (2, 1, 5, 4) and mask.shape == (2, 1, 5, 5)
        assert mx.array_equal(keys[0, :, :3], k[0, :, :3]).item() and mx.array_equal(keys[1], k[1]).item()
        assert mx.array_equal(values[1], k[1] + 1).item()
        seen = [[[bool(x) for x in row] for row in mask[b, 0].tolist()] for b in range(2)]
        assert seen[1][4] == ([True] * 5 if window is None else [False, False, False, True, True])
        assert seen[0][1] == [True, True, False, False, False]  # causal within row a
        assert seen[0][4] == ([True, True, True, False, False] if window is None else [False, True, True, False, False])  # padding: a's last


@pytest.mark.parametrize("cascade", [True, False])
def test_decoding_rows_sharing_cached_blocks_attend_them_as_one_cascade(tiny_model, monkeypatch, cascade):
    """On the gather path (MLX's ops: Metal, CUDA, kernels off), decode rows whose tables start
    with the same cached blocks attend to them once, merged with each row's own tokens by
    log-sum-exp; the logits are the model's as one sequence, as without the cascade."""
    from mlx_parallm_provider.engine.kv import cascade

    model = tiny_model.model
    calls = []
    real = cascade.cascade_attention
    monkeypatch.setattr(paged_cache, "cascade_attention", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    if not cascade:
        monkeypatch.setattr(paged_cache, "MIN_SHARED_BLOCKS", 10**6)
    prefix = list(range(7, 47))  # 10 blocks of 4
    prompts = [prefix + [60 + i] * (2 + 5 * i) for i in range(3)] + [list(range(90, 99))]  # 3 sharers, 1 not
    kv = KVCacheManager(num_blocks=64, block_size=4)
    storage = PagedKVStorage(len(model.layers), kv.pool.num_blocks, 4)
    with backends.using(model, "mlx"):
        def forward(rows, pieces, starts):
            storage.reserve(kv.pool.high_water())
            width = max(map(len, pieces))
            batch = PagedBatch(storage, [kv.table(b) for b in rows], starts, [len(p) for p in pieces], width)
            return model(mx.array([p + [0] * (width - len(p)) for p in pieces]), cache=batch.layers())

        kv.grow("p", len(prefix))
        forward(["p"], [prefix], [0])
        kv.register("p", prefix, len(prefix))
        for b, prompt in enumerate(prompts):
            hit = kv.match(prompt, len(prompt) - 1)
            kv.grow(b, len(prompt) + 1, hit)
            forward([b], [prompt[hit.tokens :]], [hit.tokens])
        assert [kv.table(b)[:10] == kv.table("p") for b in range(4)] == [True, True, True, False]
        logits = forward(list(range(4)), [[5]] * 4, [len(p) for p in prompts])[:, -1]
    for b, prompt in enumerate(prompts):
        assert mx.allclose(logits[b], _reference_logits(model, prompt + [5])[-1], atol=1e-4).item(), b
    # Own tokens 3, 8, 13 (the sharers) and 10: buckets [0] and [1, 3, 2]; per layer one cascade
    # in each, over the sharing rows of that bucket only.
    assert [sum(g.size for _, g in groups) for groups in calls] == ([1, 2] * len(model.layers) if cascade else [])
