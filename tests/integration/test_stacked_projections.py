"""Where MLX's ops compute a quantized llama, each layer's q/k/v and gate/up are one product
over their weights stacked at load (the layers keep views of them): the same logits bit for
bit, fewer products, no more memory; rows with a LoRA adapter, replaced weights and layers
quantized unalike take the layers' own products."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from gpu_kernel_emulator import traceable_gpu_backend
from mlx_parallm_provider.config import DeviceConfig
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.models import backends
from mlx_parallm_provider.models.backend import prepare_model
from mlx_parallm_provider.models.backends.stacked import GATE_UP, QKV, stack_siblings, stacked
from mlx_parallm_provider.models.device import is_cpu
from mlx_parallm_provider.models.lora.layers import MultiLoRALinear, rows_using


def _quantized(tiny_model_dir: Path, bits: int = 4) -> nn.Module:
    """A fresh copy of the tiny llama, its linear layers and (tied) embedding quantized."""
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_model_dir)
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The weight shape of each ``mx.quantized_matmul`` from now on (any thread)."""
    shapes: list[tuple[int, ...]] = []
    multiply = mx.quantized_matmul

    def recorded(x: mx.array, w: mx.array, *args, **kwargs) -> mx.array:
        shapes.append(tuple(w.shape))
        return multiply(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", recorded)
    return shapes


def _logits(model: nn.Module, tokens: mx.array) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    out = model(tokens, cache=make_prompt_cache(model))
    mx.eval(out)
    return out


@pytest.mark.parametrize("backend", ["mlx", "gpu"])
@pytest.mark.parametrize("width", [1, 5], ids=["decode", "prefill"])
def test_stacked_siblings_give_the_same_logits_bit_for_bit_in_fewer_products(tiny_model_dir, products, backend: str, width: int) -> None:
    model = _quantized(tiny_model_dir)
    tokens = mx.arange(3 * width).reshape(3, width) + 7
    layers = len(model.layers)
    with backends.using(model, traceable_gpu_backend() if backend == "gpu" else "mlx"):
        alone = _logits(model, tokens)
        assert len(products) == 7 * layers + 1  # q, k, v, o, gate, up, down; the tied head
        assert stack_siblings(model) == 2 * layers
        products.clear()
        together = _logits(model, tokens)
        assert len(products) == 4 * layers + 1  # q/k/v, o, gate/up, down; the head
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        widths = [attn[n].weight.shape[0] for n in QKV], [mlp[n].weight.shape[0] for n in GATE_UP]
        assert products[0] == (sum(widths[0]), 64 * 4 // 32)  # (the stacked rows, packed 4-bit columns)
        assert (sum(widths[1]), 64 * 4 // 32) in products
    assert mx.array_equal(together, alone)
    assert stack_siblings(model) == 0  # (once)


@pytest.mark.skipif(not is_cpu(), reason="a GPU allocator rounds buffer sizes: the figure says less there")
def test_the_layers_keep_views_of_the_stacked_weights_not_copies(tiny_model_dir) -> None:
    model = _quantized(tiny_model_dir)
    with backends.using(model, "mlx"):
        attn = model.layers[0].self_attn
        before = [mx.array(attn[n].weight) for n in QKV]
        mx.eval(before)
        mx.clear_cache()
        held = mx.get_active_memory()
        stack_siblings(model)
        mx.clear_cache()
        assert mx.get_active_memory() <= held  # (the layers' own arrays freed, the stack shared)
        stack = stacked(attn, QKV)
        assert stack is not None and mx.array_equal(stack.weight, mx.concatenate(before))
        assert all(mx.array_equal(attn[n].weight, w) for n, w in zip(QKV, before))


def test_replaced_weights_and_lora_rows_take_the_layers_own_products(tiny_model_dir) -> None:
    model = _quantized(tiny_model_dir)
    tokens = mx.array([[7, 8, 9], [10, 11, 12]])
    with backends.using(model, "mlx"):
        stack_siblings(model)
        attn, mlp = model.layers[0].self_attn, model.layers[1].mlp
        want = _logits(model, tokens)
        attn.q_proj = MultiLoRALinear(attn.q_proj, 64, 64)
        assert stacked(attn, QKV) is not None  # (a wrapped layer, no row with an adapter: its base layer alone)
        assert mx.array_equal(_logits(model, tokens), want)
        with rows_using([1, 0], [1.0, 1.0]):
            assert stacked(attn, QKV) is None
            assert stacked(mlp, GATE_UP) is not None  # (the wrapped layers' siblings only)
        mlp.up_proj.weight = mx.array(mlp.up_proj.weight)  # (a copy: the stack no longer holds the layer's weight)
        assert stacked(mlp, GATE_UP) is None
        assert mx.array_equal(_logits(model, tokens), want)


def test_layers_quantized_unalike_stay_single(tiny_model_dir) -> None:
    model = _quantized(tiny_model_dir)
    attn = model.layers[0].self_attn
    attn.k_proj = nn.QuantizedLinear.from_linear(nn.Linear(64, attn.k_proj.weight.shape[0]), group_size=32, bits=8)
    with backends.using(model, "mlx"):
        assert stack_siblings(model) == 2 * len(model.layers) - 1
        assert stacked(attn, QKV) is None and stacked(model.layers[0].mlp, GATE_UP) is not None


@pytest.mark.parametrize("setting", [True, False])
def test_loading_stacks_where_mlx_ops_compute_a_quantized_model(tiny_model_dir, setting: bool) -> None:
    model = prepare_model(_quantized(tiny_model_dir), dequantize=False, kernels=False, device=DeviceConfig(stack_projections=setting))
    assert (stacked(model.layers[0].self_attn, QKV) is not None) is setting
    dequantized = prepare_model(_quantized(tiny_model_dir), dequantize=True, kernels=False)
    assert stacked(dequantized.layers[0].self_attn, QKV) is None  # (float layers stay single)


@pytest.mark.skipif(not is_cpu(), reason="the CPU kernels' backend")
def test_the_cpu_kernels_keep_their_own_layers(tiny_model_dir) -> None:
    model = prepare_model(_quantized(tiny_model_dir), dequantize=False, kernels=True)
    assert stacked(model.layers[0].self_attn, QKV) is None and stacked(model.layers[0].mlp, GATE_UP) is None


def test_an_engine_decodes_the_same_tokens_with_projections_stacked_and_not(tiny_model_dir, make_engine) -> None:
    """Greedy, 5 rows of mixed lengths leaving one by one, on the GPU backend (decode steps
    compiled): the same tokens with each layer's siblings stacked and single."""
    prompts = [[1, 5 + i, 9, 30 + 3 * i, 7, 11, 200 + i][: 3 + i] for i in range(5)]
    params = [SamplingParams(max_tokens=5 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(5)]

    def tokens(stack: bool) -> tuple[list[list[int]], str]:
        model = _quantized(tiny_model_dir)
        with backends.using(model, traceable_gpu_backend()):
            assert stack_siblings(model) if stack else True
            engine = make_engine(model, kv_block_size=4)
            try:
                return [o.token_ids for o in engine.generate_many_sync(prompts, params)], engine.stats()["decode"]
            finally:
                engine.shutdown()

    together, decode = tokens(True)
    assert decode == "compiled"
    assert tokens(False) == (together, decode)


def test_set_aside_stacks_multiply_layer_by_layer_and_come_back(tiny_model_dir, products) -> None:
    from mlx_parallm_provider.models.backends.stacked import unstacked

    model = _quantized(tiny_model_dir)
    tokens = mx.array([[7, 8, 9]])
    with backends.using(model, "mlx"):
        stack_siblings(model)
        want = _logits(model, tokens)
        with unstacked(model) as count:
            assert count == 2 * len(model.layers)
            products.clear()
            assert mx.array_equal(_logits(model, tokens), want)
            assert len(products) == 7 * len(model.layers) + 1
        products.clear()
        _logits(model, tokens)
        assert len(products) == 4 * len(model.layers) + 1
