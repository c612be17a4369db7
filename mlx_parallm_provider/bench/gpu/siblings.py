"""A block's sibling linear layers (the same input: q/k/v, gate/up) as one product over their
weights stacked, to time against the layers' own products (``stacked_matmul_ms`` in the step
breakdown): on a GPU each product is a launch, and a narrow one (GQA's k and v projections)
fills few of the GPU's multiprocessors, so whether stacking them pays is measured before it
is built into the backend."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of one block's linear layers that take the same input."""


class Stacked(NamedTuple):
    """One group of sibling layers as one product: ``product`` takes ``(..., width)`` as
    ``(n, width)`` rows and gives ``(n, sum of the layers' outputs)``, the layers' outputs in
    the order of ``layers``."""

    product: Callable[[mx.array], mx.array]
    width: int
    layers: tuple[Any, ...]


def linear_layers(model: Any) -> list[Any]:
    """``model``'s linear layers, float or quantized, the output head aside."""
    return [mod for name, mod in model.named_modules() if isinstance(mod, (nn.Linear, nn.QuantizedLinear)) and name != "lm_head"]


def stacked_products(model: Any) -> tuple[list[Stacked], list[Any]]:
    """``(products, single)``: each group of :data:`SIBLINGS` in ``model``'s blocks whose
    layers compute alike (all float, or all quantized with the same bits, groups and mode;
    biases on all or none) as one product over their weights stacked (a copy, held by the
    product); ``single``: the model's other :func:`linear_layers`."""
    products: list[Stacked] = []
    grouped: set[int] = set()
    for _, module in model.named_modules():
        for names in SIBLINGS:
            layers = [module.get(name) for name in names]
            product = _stacked(layers)
            if product is not None:
                products.append(Stacked(*product, tuple(layers)))
                grouped.update(id(layer) for layer in layers)
    single = [mod for mod in linear_layers(model) if id(mod) not in grouped]
    return products, single


def _stacked(layers: Sequence[Any]) -> Optional[tuple[Callable[[mx.array], mx.array], int]]:
    """``layers``' product over their weights stacked, and its input width; None where they
    are not all linear layers computing alike."""
    first = layers[0]
    kind = nn.QuantizedLinear if isinstance(first, nn.QuantizedLinear) else nn.Linear
    if not all(isinstance(layer, kind) for layer in layers):
        return None
    keys = set(first.keys())
    if any(set(layer.keys()) != keys or layer.weight.shape[1] != first.weight.shape[1] for layer in layers):
        return None
    bias = mx.concatenate([layer.bias for layer in layers]) if "bias" in keys else None
    if kind is nn.QuantizedLinear:
        if any((layer.bits, layer.group_size, layer.mode) != (first.bits, first.group_size, first.mode) for layer in layers):
            return None
        weight, scales = (mx.concatenate([layer[k] for layer in layers]) for k in ("weight", "scales"))
        biases = mx.concatenate([layer.biases for layer in layers]) if "biases" in keys else None
        mx.eval(weight, scales, biases, bias)
        width = first.weight.shape[1] * 32 // first.bits

        def quantized(x: mx.array) -> mx.array:
            out = mx.quantized_matmul(x.reshape(-1, width), weight, scales=scales, biases=biases, transpose=True,
                                      group_size=first.group_size, bits=first.bits, mode=first.mode)
            return out + bias if bias is not None else out

        return quantized, width
    dense = mx.concatenate([layer.weight for layer in layers])
    mx.eval(dense, bias)
    width = dense.shape[1]

    def product(x: mx.array) -> mx.array:
        out = x.reshape(-1, width) @ dense.T
        return out + bias if bias is not None else out

    return product, width
