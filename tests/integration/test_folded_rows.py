"""On the GPU backend a quantized model's products over a step's rows are one matrix each:
MLX's CUDA backend takes ``(rows, 1, K)`` as one problem per row, every weight read again for
each. The same logits and tokens as unfolded, and a model no backend routes is untouched."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from gpu_kernel_emulator import traceable_gpu_backend
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.models import backends
from mlx_parallm_provider.models.backends.gpu_kernels import GPUKernels


def _gpu(folds_rows: bool = True) -> GPUKernels:
    backend = traceable_gpu_backend()
    backend.folds_rows = folds_rows
    return backend


def _quantized(tiny_model_dir: Path) -> nn.Module:
    """A fresh copy of the tiny llama, its linear layers and (tied) embedding quantized to 4 bits."""
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_model_dir)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())  # (here: an engine's worker evaluates on its own thread's stream)
    return model


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of ``x`` in each ``mx.quantized_matmul`` from now on (any thread)."""
    shapes: list[tuple[int, ...]] = []
    multiply = mx.quantized_matmul

    def recorded(x: mx.array, *args, **kwargs) -> mx.array:
        shapes.append(tuple(x.shape))
        return multiply(x, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", recorded)
    return shapes


@pytest.mark.parametrize("width", [1, 5], ids=["decode", "prefill"])
def test_a_steps_rows_go_through_each_quantized_layer_and_the_head_as_one_matrix(tiny_model_dir, products, width: int) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model = _quantized(tiny_model_dir)
    tokens = mx.arange(3 * width).reshape(3, width) + 7
    plain = model(tokens, cache=make_prompt_cache(model))
    assert set(products) == {(3, width, 64), (3, width, 128)}  # mlx-lm's layers: one problem per row
    products.clear()
    with backends.using(model, _gpu()):
        folded = model(tokens, cache=make_prompt_cache(model))
        assert len(products) == 7 * len(model.layers) + 1  # q, k, v, o, gate, up, down; the tied head
        assert set(products) == {(3 * width, 64), (3 * width, 128)}
    assert folded.shape == plain.shape == (3, width, model.args.vocab_size)
    assert mx.array_equal(folded, plain)
    products.clear()
    model(tokens, cache=make_prompt_cache(model))  # the backend uninstalled: mlx-lm's own layers again
    assert set(products) == {(3, width, 64), (3, width, 128)}


def test_a_backend_that_does_not_fold_leaves_the_layers_as_they_are(tiny_model_dir, products) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model = _quantized(tiny_model_dir)
    with backends.using(model, _gpu(folds_rows=False)):
        model(mx.array([[7], [8]]), cache=make_prompt_cache(model))
    assert set(products) == {(2, 1, 64), (2, 1, 128)}
    assert type(model.layers[0].mlp.up_proj) is nn.QuantizedLinear


def test_an_engine_decodes_the_same_tokens_with_its_rows_folded_and_not(tiny_model_dir, make_engine, products) -> None:
    """Greedy, 5 rows of mixed lengths leaving one by one: the same tokens; with folding, every
    quantized product of the engine's steps (prefill and decode) has 2-D rows."""
    model = _quantized(tiny_model_dir)
    prompts = [[1, 5 + i, 9, 30 + 3 * i, 7, 11, 200 + i][: 3 + i] for i in range(5)]
    params = [SamplingParams(max_tokens=5 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(5)]

    def tokens(folds_rows: bool) -> list[list[int]]:
        with backends.using(model, _gpu(folds_rows)):
            engine = make_engine(model, kv_block_size=4)
            try:
                return [o.token_ids for o in engine.generate_many_sync(prompts, params)]
            finally:
                engine.shutdown()

    folded = tokens(True)
    assert products and all(len(shape) == 2 for shape in products)
    assert max(rows for rows, _ in products) >= sum(map(len, prompts)) - len(prompts)  # (a prefill piece's rows, all of them)
    products.clear()
    assert tokens(False) == folded
    assert any(len(shape) == 3 for shape in products)


def test_the_gpu_benchmark_times_the_products_also_as_mlx_lms_own_layers_compute_them(tiny_model_dir, products) -> None:
    from mlx_parallm_provider.bench.gpu.breakdown import unrouted

    model = _quantized(tiny_model_dir)
    x = mx.ones((3, 1, 64))
    with backends.using(model, _gpu()):
        layer, embed = model.layers[0].self_attn.q_proj, model.model.embed_tokens
        assert mx.array_equal(unrouted(layer, "__call__", x), layer(x))
        assert mx.array_equal(unrouted(embed, "as_linear", x), embed.as_linear(x))
    assert products == [(3, 1, 64), (3, 64), (3, 1, 64), (3, 64)]
