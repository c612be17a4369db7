"""Convert a llama-family GGUF file into an mlx-lm model folder.

The folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the GGUF's chat template), so ``mlx_lm.load`` opens it like
any Hugging Face conversion. Quantized GGUF tensors that MLX reads natively (Q4_0, Q4_1,
Q8_0) stay quantized (MLX affine, group size 32); MLX casts other types to float16.

GGUF stores the Q and K projections permuted for interleaved ("traditional") RoPE; they
are permuted back here, so the folder uses the standard Hugging Face layout and mlx-lm's
default ``rope_traditional=False``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Union

from ..errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)
CONVERTER_VERSION = 1
GGUF_GROUP_SIZE = 32

# llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre` (see llama-vocab.cpp).
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SPLIT_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRE = {"gpt-2", "gpt2", "default", "phi-2", "jina-es", "jina-de", "jais", "olmo", "dbrx"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "smaug-bpe"}

_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def convert_gguf(gguf_path: Union[str, Path], out_dir: Union[str, Path]) -> Path:
    """Convert ``gguf_path`` into an mlx-lm model folder at ``out_dir`` and return it.

    The folder is written under a temporary name and renamed into place at the end, so a
    crash or an error never leaves a folder that later loads as broken. ``out_dir`` must
    not exist yet, or be an empty folder.

    Raises:
        ModelNotFoundError: the file does not exist.
        ModelLoadError: the file is not a readable GGUF (truncated, corrupt).
        UnsupportedModelError: the architecture or tokenizer is not supported.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"{gguf_path}: no such GGUF file")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: output folder already exists and is not empty")

    weights, metadata = _read_gguf(gguf_path)
    config = _model_config(gguf_path, metadata, weights)
    tensors = _convert_tensors(gguf_path, weights, config)
    tokenizer_json, tokenizer_config = _tokenizer_files(gguf_path, metadata)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        import mlx.core as mx

        mx.save_safetensors(str(staging / "model.safetensors"), tensors, metadata={"format": "mlx"})
        _write_json(staging / "config.json", config)
        _write_json(staging / "tokenizer.json", tokenizer_json)
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        _write_json(
            staging / "gguf_source.json",
            {"source": str(gguf_path.resolve()), "converter_version": CONVERTER_VERSION},
        )
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
    _, metadata = _read_gguf(gguf_path)
    tokenizer_json, tokenizer_config = _tokenizer_files(gguf_path, metadata)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "tokenizer.json", tokenizer_json)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    return out_dir


def _read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    if path.stat().st_size < 32:
        raise ModelLoadError(f"{path}: not a GGUF file (only {path.stat().st_size} bytes)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic number)")
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises plain RuntimeError/ValueError for corrupt files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: unreadable or truncated GGUF file ({reason})") from None
    return weights, metadata


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if hasattr(value, "item"):
        return value.item()
    return value


def _model_config(path: Path, metadata: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    arch = _scalar(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in weights or _scalar(metadata, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"{path}: RoPE scaling (rope_freqs) is not supported yet")

    def need(key: str) -> Any:
        value = _scalar(metadata, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    def count(key: str, value: Any) -> int:
        """A header value that must be a positive integer (a head count of 0 divided by zero)."""
        number = _header_number(path, f"{arch}.{key}", value, int)
        if number <= 0:
            raise ModelLoadError(f"{path}: invalid GGUF header: {arch}.{key} = {number}, must be a positive integer")
        return number

    def real(key: str, default: float) -> float:
        number = _header_number(path, f"{arch}.{key}", _scalar(metadata, f"{arch}.{key}", default), float)
        if not math.isfinite(number) or number <= 0:
            raise ModelLoadError(f"{path}: invalid GGUF header: {arch}.{key} = {number}, must be a positive number")
        return number

    hidden = count("embedding_length", need("embedding_length"))
    heads = count("attention.head_count", need("attention.head_count"))
    kv_heads = count("attention.head_count_kv", _scalar(metadata, f"{arch}.attention.head_count_kv", heads))
    if heads % kv_heads:
        raise ModelLoadError(
            f"{path}: invalid GGUF header: {arch}.attention.head_count ({heads}) is not a multiple of "
            f"{arch}.attention.head_count_kv ({kv_heads})"
        )
    key_length = _scalar(metadata, f"{arch}.attention.key_length")
    if key_length is None and hidden % heads:
        raise ModelLoadError(
            f"{path}: invalid GGUF header: {arch}.embedding_length ({hidden}) is not a multiple of "
            f"{arch}.attention.head_count ({heads}), and {arch}.attention.key_length is not given"
        )
    head_dim = count("attention.key_length", hidden // heads if key_length is None else key_length)
    if head_dim % 2:
        raise ModelLoadError(f"{path}: invalid GGUF header: the head size ({head_dim}) is odd; RoPE needs an even one")
    layers = count("block_count", need("block_count"))
    blocks = {int(n.split(".")[1]) for n in weights if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if blocks != set(range(layers)):
        raise ModelLoadError(
            f"{path}: invalid GGUF header: {arch}.block_count = {layers}, but the file holds tensors of "
            f"{len(blocks)} blocks ({', '.join(map(str, sorted(blocks)[:3]))}{', ...' if len(blocks) > 3 else ''})"
        )
    tokens = len(metadata.get("tokenizer.ggml.tokens", []))
    vocab = tokens or count("vocab_size", need("vocab_size"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": count("feed_forward_length", need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": real("attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": vocab,
        "rope_theta": real("rope.freq_base", 10000.0),
        "rope_traditional": False,
        "max_position_embeddings": count("context_length", _scalar(metadata, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = _scalar(metadata, f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    return config


def _header_number(path: Path, key: str, value: Any, kind: type) -> Any:
    """``value`` of GGUF header ``key`` as an int or float, or a ModelLoadError naming the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ModelLoadError(f"{path}: invalid GGUF header: {key} = {value!r}, must be a {'whole ' if kind is int else ''}number")
    return kind(value)


def _hf_name(path: Path, gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.{suffix}"
    raise UnsupportedModelError(f"{path}: unexpected tensor {gguf_name!r} for a llama model")


def _unpermute_rows(path: Path, name: str, w: Any, n_heads: int, head_dim: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE layout)."""
    rows = w.shape[0]
    if rows != n_heads * head_dim:
        raise ModelLoadError(
            f"{path}: invalid GGUF header: tensor {name!r} has {rows} rows, but the header's "
            f"{n_heads} heads of {head_dim} need {n_heads * head_dim}"
        )
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _convert_tensors(path: Path, weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    bits_by_module: dict[str, int] = {}
    for gguf_name, array in weights.items():
        name = _hf_name(path, gguf_name)
        if ".attn_q." in gguf_name:
            array = _unpermute_rows(path, gguf_name, array, config["num_attention_heads"], config["head_dim"])
        elif ".attn_k." in gguf_name:
            array = _unpermute_rows(path, gguf_name, array, config["num_key_value_heads"], config["head_dim"])
        tensors[name] = array
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            packed = weights[gguf_name.replace(".scales", ".weight")]
            in_features = array.shape[-1] * GGUF_GROUP_SIZE
            bits_by_module[module] = packed.shape[-1] * 32 // in_features
    if bits_by_module:
        common_bits = Counter(bits_by_module.values()).most_common(1)[0][0]
        quantization: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": common_bits}
        for module, bits in bits_by_module.items():
            if bits != common_bits:
                quantization[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return tensors


def _pre_tokenizer(path: Path, pre: str) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    if pre in _SPLIT_DIGITS_PRE:
        regexes = [r"\p{N}", _GPT2_REGEX]
    elif pre in _GPT2_PRE:
        regexes = [_GPT2_REGEX]
    elif pre in _LLAMA3_PRE:
        regexes = [_LLAMA3_REGEX]
    else:
        raise UnsupportedModelError(f"{path}: tokenizer pre-tokenizer {pre!r} is not supported")
    splits = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in regexes
    ]
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def _tokenizer_files(path: Path, metadata: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    model = _scalar(metadata, "tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"{path}: tokenizer model {model!r} is not supported (supported: gpt2 byte-level BPE)"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else [1] * len(tokens)
    merges = [m.split(" ", 1) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre = _scalar(metadata, "tokenizer.ggml.pre", "default")

    # token_type 3 = control (special), 4 = user-defined (added but not special).
    added_tokens = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": kind != 3,
            "special": kind == 3,
        }
        for i, kind in enumerate(token_types)
        if kind in (3, 4)
    ]

    def token_at(key: str) -> str | None:
        idx = _scalar(metadata, f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", False))
    post_processor = None
    if add_bos and bos is not None:
        bos_id = int(_scalar(metadata, "tokenizer.ggml.bos_token_id"))
        post_processor = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(path, pre),
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": int(_scalar(metadata, f"{_scalar(metadata, 'general.architecture')}.context_length", 2048)),
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "additional_special_tokens": [t["content"] for t in added_tokens if t["special"]],
    }
    chat_template = _scalar(metadata, "tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer_json, tokenizer_config


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
