"""An mlx-lm LoRA adapter folder read and checked against a base model.

``mlx_lm.lora`` writes ``adapter_config.json`` (``fine_tune_type``, ``num_layers``,
``lora_parameters``: ``rank``, ``scale``, ``dropout``, optional ``keys``) and
``adapters.safetensors`` (``<module path>.lora_a``, ``(input_dims, rank)``, and ``.lora_b``,
``(rank, output_dims)``, for each adapted linear layer). ``mlx_lm.load(base, adapter_path=...)``
wraps those layers in ``LoRALinear`` (``y = linear(x) + scale * ((x @ lora_a) @ lora_b)``); an
:class:`AdapterFiles` holds the same arrays, for :mod:`.slots` to apply per row.

Every problem (missing files, a DoRA or full fine-tune, a layer the model lacks, shapes that
are not the base's, a rank that is not the file's) is an :class:`InvalidParameterError` on
``lora``, the caller's 400.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ...errors import InvalidParameterError
from .layers import MultiLoRALinear, base_linear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"


@dataclass(frozen=True)
class AdapterFiles:
    """One adapter's low-rank pairs, keyed by the adapted module's path in the model
    (``model.layers.12.self_attn.q_proj``), with its ``rank`` and ``scale``. ``uid`` names its
    content (config and weights): blocks of KV computed through it are named under it."""

    path: Path
    rank: int
    scale: float
    pairs: dict[str, tuple[mx.array, mx.array]]
    uid: str

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def _bad(path: Path, message: str) -> InvalidParameterError:
    return InvalidParameterError("lora", f"adapter {str(path)!r}: {message}")


def read_adapter(path: str | Path, model: Any) -> AdapterFiles:
    """Read the adapter folder ``path`` and check it fits ``model`` (an mlx-lm model)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise _bad(path, "no such adapter folder")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise _bad(path, f"missing {name} (an mlx-lm LoRA adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    config_bytes = (path / CONFIG_FILE).read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise _bad(path, f"{CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _bad(path, f"{CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise _bad(path, f"fine_tune_type {kind!r} is not supported (only 'lora'; fuse a {kind} adapter into the model with mlx_lm.fuse)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise _bad(path, f"{CONFIG_FILE} has no lora_parameters object")
    rank, scale = params.get("rank"), params.get("scale")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _bad(path, f"lora_parameters.rank must be a positive integer, got {rank!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise _bad(path, f"lora_parameters.scale must be a finite number, got {scale!r}")
    num_layers, keys = config.get("num_layers"), params.get("keys")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise _bad(path, f"num_layers must be an integer, got {num_layers!r}")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise _bad(path, f"lora_parameters.keys must be a list of layer names, got {keys!r}")
    weights_bytes = (path / WEIGHTS_FILE).read_bytes()
    try:
        weights = mx.load(str(path / WEIGHTS_FILE))
    except Exception as exc:  # mlx raises RuntimeError / ValueError for a damaged file
        raise _bad(path, f"{WEIGHTS_FILE} could not be read ({exc})") from None
    pairs = _pairs(path, weights, rank, _adaptable(model, num_layers, keys))
    uid = hashlib.blake2b(config_bytes + b"\0" + weights_bytes, digest_size=16).hexdigest()
    return AdapterFiles(path=path.resolve(), rank=rank, scale=float(scale), pairs=pairs, uid=uid)


def _adaptable(model: Any, num_layers: int, keys: Optional[list[str]]) -> dict[str, tuple[int, int]]:
    """``(input_dims, output_dims)`` of each linear layer mlx-lm's ``linear_to_lora_layers``
    adapts for this config (in the last ``num_layers`` decoder layers, all of them where it is
    0 or less; those named ``keys``, every linear layer where None), by its path in the model."""
    layers = model.layers
    first = len(layers) - num_layers if num_layers > 0 else 0
    where = next(name for name, module in model.named_modules() if module is layers[0]).rpartition(".")[0]  # "model.layers"
    out: dict[str, tuple[int, int]] = {}
    for index in range(max(first, 0), len(layers)):
        modules = layers[index].named_modules()
        wrapped = {name for name, module in modules if isinstance(module, MultiLoRALinear)}
        for name, module in modules:
            base = base_linear(module)
            if name.rpartition(".")[0] in wrapped or not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
                continue  # (the base inside a wrapper goes by the wrapper's name)
            if keys is None or name in keys:
                out[f"{where}.{index}.{name}"] = linear_dims(base)
    return out


def linear_dims(linear: Any) -> tuple[int, int]:
    """A linear layer's ``(input_dims, output_dims)``, whatever holds its weights."""
    source = getattr(linear, "_source", None)
    if source is not None:  # :class:`..small_batch.SmallBatchLinear`: columns of a packed weight
        start, stop = linear._columns
        return source.packed.shape[1], stop - start
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


def _pairs(path: Path, weights: dict[str, mx.array], rank: int, linears: dict[str, tuple[int, int]]) -> dict[str, tuple[mx.array, mx.array]]:
    """The ``(lora_a, lora_b)`` of each adapted layer, checked against the model's layers."""
    found: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise _bad(path, f"{key}: not a LoRA parameter (a DoRA adapter's magnitudes, or a full fine-tune, are not supported)")
        if module not in linears:
            raise _bad(path, f"{key}: the model has no linear layer {module!r} (an adapter for another base model?)")
        found.setdefault(module, {})[leaf] = value
    if not found:
        raise _bad(path, f"{WEIGHTS_FILE} holds no lora_a / lora_b arrays")
    pairs: dict[str, tuple[mx.array, mx.array]] = {}
    for module, leaves in found.items():
        if "lora_b" not in leaves:
            continue  # mlx-lm starts lora_b at zeros: without one the layer is unchanged
        if "lora_a" not in leaves:
            raise _bad(path, f"{module}: lora_b without lora_a")
        a, b = leaves["lora_a"], leaves["lora_b"]
        in_dims, out_dims = linears[module]
        if a.shape != (in_dims, rank) or b.shape != (rank, out_dims):
            raise _bad(path, f"{module}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not fit the base layer "
                             f"({in_dims} -> {out_dims}) at rank {rank}: expected {(in_dims, rank)} / {(rank, out_dims)}")
        if not (mx.issubdtype(a.dtype, mx.floating) and mx.issubdtype(b.dtype, mx.floating)):
            raise _bad(path, f"{module}: lora_a / lora_b must be floating point, got {a.dtype} / {b.dtype}")
        pairs[module] = (a, b)
    return pairs
