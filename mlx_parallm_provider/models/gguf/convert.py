"""Convert a GGUF file into an mlx-lm model folder, tensor by tensor."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Union

from ...errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from . import tensors as tensor_types
from .architectures import ARCHITECTURES, Architecture, architecture_of, hf_name, model_config, unpermute_rows
from .reader import GGUFFile
from .tokenizer import SUPPORTED_TOKENIZERS, stop_token_ids, tokenizer_files

_SHARD_BYTES = 2 << 30  # a new model-NNNNN.safetensors after this many bytes
CONVERTER_VERSION = 3  # 3: biases kept (Qwen 2 folders converted by 2 saved them over their weights)
"""Recorded in each converted folder; part of the cache key of conversions (:mod:`..registry`)."""


def convert_gguf(gguf_path: Union[str, Path], out_dir: Union[str, Path]) -> Path:
    """Convert ``gguf_path`` into an mlx-lm model folder at ``out_dir`` and return it.

    The folder is written under a temporary name and renamed into place at the end, so a
    crash or an error never leaves a folder that later loads as broken. ``out_dir`` must
    not exist yet, or be an empty folder.

    Raises:
        ModelNotFoundError: the file does not exist.
        ModelLoadError: the file is not a readable GGUF (truncated, corrupt) or its header is invalid.
        UnsupportedModelError: the architecture, a tensor type or the tokenizer is not supported.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"{gguf_path}: no such GGUF file")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: output folder already exists and is not empty")

    gguf = GGUFFile(gguf_path)
    arch, spec = architecture_of(gguf, lambda: describe(gguf))
    unsupported = sorted({i.type_name for i in gguf.tensors.values()} - set(tensor_types.SUPPORTED_TYPES))
    if unsupported:
        raise UnsupportedModelError(
            f"{gguf_path}: tensor type {', '.join(unsupported)} is not supported "
            f"(supported: {', '.join(tensor_types.SUPPORTED_TYPES)}; the file has {describe(gguf)})"
        )
    config = model_config(gguf, arch, spec)
    names = {name: hf_name(gguf, spec, name) for name in gguf.tensors}
    tokenizer_json, tokenizer_config = tokenizer_files(gguf_path, gguf.metadata)
    stops = stop_token_ids(gguf.metadata)
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if gguf.metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(gguf.metadata["tokenizer.ggml.bos_token_id"])

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        config.update(_write_weights(gguf, spec, config, names, staging))
        _write_json(staging / "config.json", config)
        _write_json(staging / "tokenizer.json", tokenizer_json)
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        _write_json(staging / "gguf_source.json", {"source": str(gguf_path.resolve()), "converter_version": CONVERTER_VERSION})
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above; rename needs the name free
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def read_gguf_tokenizer(gguf_path: Union[str, Path], out_dir: Union[str, Path]) -> Path:
    """Write only the tokenizer files of ``gguf_path`` into ``out_dir`` (for tests and tools)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"{gguf_path}: no such GGUF file")
    tokenizer_json, tokenizer_config = tokenizer_files(gguf_path, GGUFFile(gguf_path).metadata)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "tokenizer.json", tokenizer_json)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    return out_dir


def describe(gguf: GGUFFile) -> str:
    """What a file holds, for error messages: architecture, tensor types, tokenizer."""
    kinds = Counter(i.type_name for i in gguf.tensors.values())
    return (
        f"architecture {gguf.metadata.get('general.architecture')!r}, tensor types "
        f"{', '.join(f'{k} x{n}' for k, n in kinds.most_common())}, tokenizer "
        f"{gguf.metadata.get('tokenizer.ggml.model')!r}; supported architectures {', '.join(ARCHITECTURES)}, "
        f"tokenizers {', '.join(SUPPORTED_TOKENIZERS)}"
    )


def _write_weights(gguf: GGUFFile, spec: Architecture, config: dict[str, Any], names: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Convert and save every weight, a shard at a time; return the config's quantization keys."""
    import mlx.core as mx

    shard: dict[str, Any] = {}
    shard_bytes, shard_index, bits_by_module = 0, 1, {}

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_index
        name = "model.safetensors" if shard_index == 1 else f"model-{shard_index:05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        shard, shard_bytes, shard_index = {}, 0, shard_index + 1

    for gguf_name, info in gguf.tensors.items():
        name = names[gguf_name]
        if name is None:
            continue
        arrays, bits = tensor_types.convert(info.type_name, info.shape, gguf.data(info))
        if spec.permute_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = config["num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"]
            arrays = {k: unpermute_rows(gguf, gguf_name, v, heads, config["head_dim"]) for k, v in arrays.items()}
        if spec.norm_offset and gguf_name.endswith("norm.weight"):
            arrays["weight"] = arrays["weight"].astype(mx.float32) - spec.norm_offset
        module, _, suffix = name.rpartition(".")
        if suffix != "weight":  # a bias (Qwen 2's Q / K / V): one float vector, saved under its own name
            arrays = {suffix: arrays["weight"]}
        for key, array in arrays.items():
            mx.eval(array)
            shard[f"{module}.{key}"] = array
            shard_bytes += array.nbytes
        if bits is not None:
            bits_by_module[module] = bits
        if shard_bytes >= _SHARD_BYTES:
            flush()
    if shard or shard_index == 1:
        flush()
    if not bits_by_module:
        return {}
    common = Counter(bits_by_module.values()).most_common(1)[0][0]
    group = tensor_types.GROUP_SIZE
    quantization: dict[str, Any] = {"group_size": group, "bits": common}
    quantization.update({m: {"group_size": group, "bits": b} for m, b in bits_by_module.items() if b != common})
    return {"quantization": quantization, "quantization_config": quantization}


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
