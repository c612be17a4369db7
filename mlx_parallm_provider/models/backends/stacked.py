"""Sibling quantized layers (one block's q/k/v, its gate/up: the same input) as one product over
their weights stacked, as vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` compute them.

On a GPU each product is a launch that reads its input again, and a narrow one (GQA's k and v
projections) fills few of the GPU's multiprocessors. :func:`stack_siblings` stacks each plain
llama / qwen2 attention's q/k/v and MLP's gate/up once at load, where they are quantized alike
(the same bits, group size and mode; biases on all or none): the stacked weights are one array
each, and the layers keep views of their rows (no second copy). The routed attention and MLP
(:mod:`.routing`) then make one product where mlx-lm makes three or two, its rows folded into
one matrix (:mod:`.folded_rows`), and split its output. A quantized product's output columns do
not depend on the columns beside them, so each layer's output is its own product's, bit for bit
on the CPU (the tests check it; the GPU tests on the device). Rows with a LoRA adapter, and
layers whose weights were replaced since, take the layers' own products.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..lora.layers import MultiLoRALinear, base_linear, current_rows
from .attention_step import fusable, original_class, plain_code

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
PLAIN_MLPS = (("mlx_lm.models.llama", "MLP"), ("mlx_lm.models.qwen2", "MLP"))
"""mlx-lm MLPs whose ``__call__`` is ``down_proj(swiglu(gate_proj(x), up_proj(x)))``."""
_ATTRIBUTE = "_parallm_stacked"  # on an attention or MLP module: its StackedLinear
_KEYS = ("weight", "scales", "biases", "bias")


class StackedLinear:
    """Sibling ``nn.QuantizedLinear`` layers' weights stacked into one array each (the layers
    left holding views of their rows): one product, split into each layer's output."""

    def __init__(self, names: tuple[str, ...], layers: Sequence[nn.QuantizedLinear]) -> None:
        first = layers[0]
        self.names = names
        self.bits, self.group_size, self.mode = first.bits, first.group_size, first.mode
        self.input_dims = first.weight.shape[1] * 32 // first.bits
        keys = [k for k in _KEYS if k in first]
        stacked = {k: mx.concatenate([layer[k] for layer in layers]) for k in keys}
        mx.eval(stacked)
        self.weight, self.scales = stacked["weight"], stacked["scales"]
        self.biases, self.bias = stacked.get("biases"), stacked.get("bias")
        self.edges = [0]
        for layer in layers:
            self.edges.append(self.edges[-1] + layer.weight.shape[0])
        for layer, lo, hi in zip(layers, self.edges, self.edges[1:]):
            for k in keys:
                layer[k] = stacked[k][lo:hi]  # (a view: a slice of rows shares the stacked array's memory)
        mx.eval([layer.parameters() for layer in layers])
        self._views = [layer["weight"] for layer in layers]

    def holds(self, layers: Sequence[Any]) -> bool:
        """Whether ``layers`` (or the layers a LoRA wrapper keeps) still hold this stack's views."""
        return len(layers) == len(self._views) and all(base_linear(a).get("weight") is b for a, b in zip(layers, self._views))

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each layer's output of ``x`` ``(..., K)``, from one product over ``x``'s rows folded."""
        lead = x.shape[:-1]
        out = mx.quantized_matmul(x.reshape(-1, x.shape[-1]), self.weight, scales=self.scales, biases=self.biases, transpose=True,
                                  group_size=self.group_size, bits=self.bits, mode=self.mode)
        if self.bias is not None:
            out = out + self.bias
        return mx.split(out.reshape(*lead, out.shape[-1]), self.edges[1:-1], axis=-1)


def _quantized_as(layer: nn.QuantizedLinear) -> tuple[Any, ...]:
    """What a stack's layers must share: bits, group size, mode, packed input width and the arrays they hold."""
    return layer.bits, layer.group_size, layer.mode, layer.weight.shape[1], frozenset(k for k in _KEYS if k in layer)


def _stackable(layers: Sequence[Any]) -> bool:
    """Whether ``layers`` are all plain quantized linear layers computing alike, over one input width."""
    if not all(original_class(layer) is nn.QuantizedLinear for layer in layers):
        return False
    return len({_quantized_as(layer) for layer in layers}) == 1


def siblings_of_class(cls: type) -> Optional[tuple[str, ...]]:
    """The names of the sibling layers a stacked product may take in a module of class ``cls``
    (the class :func:`.routing.route` derived from): q/k/v of a plain llama / qwen2 attention,
    gate/up of its MLP; None for any other class."""
    if fusable(cls):
        return QKV
    if plain_code(cls, PLAIN_MLPS):
        return GATE_UP
    return None


def stack_siblings(model: Any) -> int:
    """Stack the sibling layers of each of ``model``'s modules that :func:`siblings_of_class` names,
    where :func:`_stackable`; returns how many groups were stacked."""
    count = 0
    for _, module in model.named_modules() if hasattr(model, "named_modules") else ():
        names = siblings_of_class(original_class(module))
        if names is None or getattr(module, _ATTRIBUTE, None):
            continue
        layers = [module.get(name) for name in names]
        if all(layer is not None for layer in layers) and _stackable(layers):
            object.__setattr__(module, _ATTRIBUTE, StackedLinear(names, layers))  # (not a child: no parameters of its own)
            count += 1
    return count


def stacked(module: Any, names: tuple[str, ...]) -> Optional[StackedLinear]:
    """``module``'s stacked product of its layers ``names`` where it applies to this pass: the
    layers still hold its views and no row of the pass has a LoRA adapter on them; else None."""
    stack = getattr(module, _ATTRIBUTE, None)
    if stack is None or stack.names != names:
        return None
    layers = [module[name] for name in names]
    if current_rows() is not None and any(isinstance(layer, MultiLoRALinear) for layer in layers):
        return None
    return stack if stack.holds(layers) else None


def projections(module: Any, x: mx.array, names: tuple[str, ...]) -> list[mx.array]:
    """Each of ``module``'s layers ``names`` applied to ``x``: by their stacked product where
    it applies (:func:`stacked`), else by each layer."""
    stack = stacked(module, names)
    return stack(x) if stack is not None else [module[name](x) for name in names]


def qkv_projections(attention: Any, x: mx.array) -> list[mx.array]:
    """A plain attention's queries, keys and values of ``x`` (:func:`projections` of :data:`QKV`)."""
    return projections(attention, x, QKV)


def stacking_mlp(backend: Any) -> Callable[[Any, mx.array], mx.array]:
    """A :data:`PLAIN_MLPS` ``__call__`` whose gate and up projections are :func:`projections`,
    their SwiGLU ``backend``'s."""

    def __call__(self: Any, x: mx.array) -> mx.array:
        gate, up = projections(self, x, GATE_UP)
        return self.down_proj(backend.swiglu(gate, up))

    return __call__


@contextlib.contextmanager
def unstacked(model: Any) -> Iterator[int]:
    """Within the block, ``model``'s stacked siblings multiply layer by layer (as with
    ``stack_projections`` off; the benchmark's comparison), stacked again after; yields how
    many stacks were set aside."""
    held = [(module, getattr(module, _ATTRIBUTE)) for _, module in model.named_modules() if getattr(module, _ATTRIBUTE, None)]
    for module, _ in held:
        object.__delattr__(module, _ATTRIBUTE)
    try:
        yield len(held)
    finally:
        for module, stack in held:
            object.__setattr__(module, _ATTRIBUTE, stack)
