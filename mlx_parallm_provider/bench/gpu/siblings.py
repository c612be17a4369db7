"""A model's linear layers as its engine multiplies them at a decode step: each stack of sibling
layers (:mod:`...models.backends.stacked`: q/k/v, gate/up) as one product, every other linear
layer alone; for the step breakdown's ``matmul_ms``, against ``unstacked_matmul_ms`` (every
layer its own product)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ...models.backends.stacked import GATE_UP, QKV, stacked


class Product(NamedTuple):
    """One product of a step: ``product`` takes ``(..., width)``."""

    product: Callable[[mx.array], Any]
    width: int


def linear_layers(model: Any) -> list[Any]:
    """``model``'s linear layers, float or quantized, the output head aside."""
    return [mod for name, mod in model.named_modules() if isinstance(mod, (nn.Linear, nn.QuantizedLinear)) and name != "lm_head"]


def in_dims(layer: Any) -> int:
    """A linear layer's input width."""
    return layer.weight.shape[-1] * (32 // layer.bits if isinstance(layer, nn.QuantizedLinear) else 1)


def engine_products(model: Any) -> list[Product]:
    """``model``'s :func:`linear_layers` as its engine multiplies them where no row has a LoRA
    adapter: the siblings its loading stacked as one product each, every other layer alone."""
    out: list[Product] = []
    grouped: set[int] = set()
    for _, module in model.named_modules():
        for names in (QKV, GATE_UP):
            stack = stacked(module, names)
            if stack is not None:
                out.append(Product(stack, stack.input_dims))
                grouped.update(id(module[name]) for name in names)
    return out + [Product(layer, in_dims(layer)) for layer in linear_layers(model) if id(layer) not in grouped]
