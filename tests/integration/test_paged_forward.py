"""A forward pass over paged KV gives what mlx-lm's own single-sequence cache gives."""

from __future__ import annotations

import mlx_parallm_provider  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_parallm_provider.engine.kv import KVCacheManager
from mlx_parallm_provider.engine.kv import paged_cache
from mlx_parallm_provider.engine.kv.paged_cache import PagedBatch
from mlx_parallm_provider.engine.kv.storage import PagedKVStorage
from mlx_parallm_provider.models import attention, backends


def _reference_logits(model, tokens: list[int]) -> mx.array:
    """Each position's logits, one token at a time through mlx-lm's KVCache."""
    cache = [KVCache() for _ in model.layers]
    return mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens])


@pytest.fixture(params=["kernels", "gather"])
def cpu_ops(request, monkeypatch, tiny_model):
    """Decode steps through the paged CPU kernel (the model's own backend), or (forced: MLX's
    ops as its backend) the gather path every device without one takes; yields the kernel's
    results, to check which path ran."""
    results: list = []
    kernel = attention.paged_decode_attention

    def counted(*args, **kwargs):
        results.append(kernel(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(attention, "paged_decode_attention", counted)
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
    storage = PagedKVStorage(len(model.layers), kv.pool.num_blocks, block_size)
    done = [0] * len(prompts)
    got: list[list[mx.array]] = [[] for _ in prompts]

    def run(rows: list[int], width: int) -> None:
        pieces = [prompts[b][done[b] : done[b] + width] for b in rows]
        for b, piece in zip(rows, pieces):
            kv.grow(b, done[b] + len(piece))
        storage.reserve(kv.pool.high_water())
        batch = PagedBatch(storage, [kv.table(b) for b in rows], [done[b] for b in rows], [len(p) for p in pieces], width)
        tokens = mx.array([p + [0] * (width - len(p)) for p in pieces])
        logits = model(tokens, cache=batch.layers())
        for i, (b, piece) in enumerate(zip(rows, pieces)):
            got[b].append(logits[i, : len(piece)])
            done[b] += len(piece)

    run([0, 1, 2], 7)  # right-padded prefill, row 0 ends inside it
    run([1, 2], 5)  # chunks continue where each row stands
    while any(done[b] < len(prompts[b]) for b in range(3)):
        run([b for b in range(3) if done[b] < len(prompts[b])], 1)  # one token a row, like decode
    for b, prompt in enumerate(prompts):
        ours = mx.concatenate(got[b])
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
