"""Per-architecture knowledge: GGUF metadata -> mlx-lm config, GGUF tensor names -> mlx-lm's.

llama.cpp's ``convert_hf_to_gguf.py`` permutes the Q / K rows only for architectures it runs
with interleaved ("normal") RoPE: llama (Llama, Mistral, SmolLM, TinyLlama). Qwen 2 / 3,
Gemma 3 and Phi-3 use NeoX RoPE and are stored as in Hugging Face. Gemma's RMSNorm scales by
``1 + w``; llama.cpp stores ``1 + w``, mlx-lm's ``gemma3_text`` wants ``w``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ...errors import ModelLoadError, UnsupportedModelError
from .header import Header
from .reader import GGUFFile
from .rope import llama3_scaling

_LLAMA_LAYER = {
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that are not weights: folded into the config by the architecture's config function.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture becomes an mlx-lm model."""

    model_type: str
    hf_class: str
    layer_names: dict[str, str]
    permute_qk: bool = False
    norm_offset: float = 0.0  # subtracted from every ``*norm.weight``
    extra_config: Callable[[Header, GGUFFile, dict[str, Any]], dict[str, Any]] = field(default=lambda h, f, c: {})


def _llama_extra(header: Header, gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {"attention_bias": False, "mlp_bias": False}
    scaling = _rope_scaling(header)
    if "rope_freqs.weight" in gguf.tensors:
        info = gguf.tensors["rope_freqs.weight"]
        freqs = gguf.data(info).view(np.float32) if info.type_name == "F32" else None
        scaling = None if freqs is None else llama3_scaling(freqs, config["rope_theta"], config["head_dim"])
        if scaling is None:
            raise UnsupportedModelError(
                f"{gguf.path}: its rope_freqs tensor is not Llama 3 RoPE scaling (the only form supported)"
            )
    if scaling:
        extra["rope_scaling"] = scaling
    return extra


def _gemma3_extra(header: Header, gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp hard-codes these for Gemma 3 (src/llama-model.cpp): every 6th layer global,
    # local layers at base 10000, and the query scale 1/sqrt(head_dim) except for 27B (62 layers).
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    pre_attn = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else head_dim
    extra: dict[str, Any] = {
        "sliding_window": header.count("attention.sliding_window", 512),
        "sliding_window_pattern": header.count("attention.sliding_window_pattern", 6),
        "rope_local_base_freq": header.real("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": pre_attn,
        "rope_scaling": _rope_scaling(header),
    }
    return extra


def _phi3_extra(header: Header, gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    rotary = header.count("rope.dimension_count", config["head_dim"])
    extra: dict[str, Any] = {
        "partial_rotary_factor": rotary / config["head_dim"],
        "original_max_position_embeddings": header.count("rope.scaling.original_context_length", config["max_position_embeddings"]),
    }
    if "rope_factors_long.weight" in gguf.tensors:
        extra["rope_scaling"] = _longrope_scaling(header, gguf, rotary, config["max_position_embeddings"], extra["original_max_position_embeddings"])
    return extra


def _rope_factors(gguf: GGUFFile, name: str, size: int) -> list[float]:
    info = gguf.tensors[name]
    if info.type_name != "F32" or int(np.prod(info.shape)) != size:
        raise ModelLoadError(f"{gguf.path}: invalid GGUF header: {name!r} should hold {size} float32 values "
                             f"(half the rotary dimensions), it holds {int(np.prod(info.shape))} of {info.type_name}")
    return [float(x) for x in gguf.data(info).view(np.float32).reshape(-1)]


def _longrope_scaling(header: Header, gguf: GGUFFile, rotary: int, context: int, original: int) -> dict[str, Any]:
    """Phi-3.5 / Phi-4-mini LongRoPE (llama.cpp's ``rope_factors_long`` / ``_short`` tensors) as
    the Hugging Face ``rope_scaling`` mlx-lm's ``phi3`` reads. mlx-lm derives the attention
    factor from the context lengths, as llama.cpp's converter wrote it; a file with another
    one is refused rather than run with the wrong scale."""
    long = _rope_factors(gguf, "rope_factors_long.weight", rotary // 2)
    short = _rope_factors(gguf, "rope_factors_short.weight", rotary // 2) if "rope_factors_short.weight" in gguf.tensors else long
    factor = context / original
    derived = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    given = header.real("rope.scaling.attn_factor", derived)
    if abs(given - derived) > 1e-4 * derived:
        raise UnsupportedModelError(
            f"{gguf.path}: LongRoPE attention factor {given:.6g} is not the one mlx-lm's phi3 derives from the "
            f"context lengths ({context} / {original}: {derived:.6g})"
        )
    return {"type": "longrope", "long_factor": long, "short_factor": short}


# YaRN settings mlx-lm's YarnRoPE cannot take, with the value each has when unused.
_YARN_NEUTRAL = {"rope.scaling.yarn_log_multiplier": (0.0,), "rope.scaling.yarn_attn_factor": (1.0,),
                 "rope.scaling.attn_factor": (1.0,), "rope.scaling.yarn_ext_factor": (-1.0, 1.0)}


def _rope_scaling(header: Header) -> Optional[dict[str, Any]]:
    """The file's RoPE scaling as the Hugging Face ``rope_scaling`` mlx-lm's models read
    (``initialize_rope``): linear, or YaRN (factor, original context, beta fast / slow; the
    attention factor mlx-lm derives from the factor, as llama.cpp does by default)."""
    kind = header.raw("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = header.real("rope.scaling.factor", 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "type": "linear", "factor": factor}
    if kind != "yarn":
        raise UnsupportedModelError(f"{header.path}: RoPE scaling {kind!r} is not supported (supported: linear, yarn, llama3)")
    for key, neutral in _YARN_NEUTRAL.items():
        value = header.raw(key)
        if value is not None and not any(abs(header.number(key, value, float) - n) < 1e-6 for n in neutral):
            raise UnsupportedModelError(f"{header.path}: YaRN with {header.arch}.{key} = {value} is not supported (mlx-lm's YaRN has no such setting)")
    return {
        "rope_type": "yarn", "type": "yarn", "factor": factor,
        "original_max_position_embeddings": header.count("rope.scaling.original_context_length"),
        "beta_fast": header.real("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": header.real("rope.scaling.yarn_beta_slow", 1.0),
    }


def _qwen_extra(header: Header, gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    scaling = _rope_scaling(header)
    return {"rope_scaling": scaling} if scaling else {}


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", _LLAMA_LAYER, permute_qk=True, extra_config=_llama_extra),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER, extra_config=_qwen_extra),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORMS}, extra_config=_qwen_extra),
    "gemma3": Architecture(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {
            **{k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm"},
            **_QK_NORMS,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
        extra_config=_gemma3_extra,
    ),
    "phi3": Architecture(
        "phi3",
        "Phi3ForCausalLM",
        {
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",  # gate and up fused, gate first, as in Hugging Face
            "ffn_down": "mlp.down_proj",
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        extra_config=_phi3_extra,
    ),
}


def architecture_of(gguf: GGUFFile, describe: Callable[[], str]) -> tuple[str, Architecture]:
    arch = gguf.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)}; "
            f"the file has {describe()})"
        )
    return arch, ARCHITECTURES[arch]


def model_config(gguf: GGUFFile, arch: str, spec: Architecture) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for the file (validated; bad values name their key)."""
    header = Header(gguf.path, gguf.metadata, arch)
    hidden = header.count("embedding_length")
    heads = header.count("attention.head_count")
    kv_heads = header.count("attention.head_count_kv", heads)
    if heads % kv_heads:
        header.invalid(
            f"{arch}.attention.head_count ({heads}) is not a multiple of {arch}.attention.head_count_kv ({kv_heads})"
        )
    key_length = header.raw("attention.key_length")
    if key_length is None and hidden % heads:
        header.invalid(
            f"{arch}.embedding_length ({hidden}) is not a multiple of {arch}.attention.head_count ({heads}), "
            f"and {arch}.attention.key_length is not given"
        )
    head_dim = header.count("attention.key_length", hidden // heads if key_length is None else key_length)
    if head_dim % 2:
        header.invalid(f"the head size ({head_dim}) is odd; RoPE needs an even one")
    layers = header.count("block_count")
    blocks = {int(n.split(".")[1]) for n in gguf.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if blocks != set(range(layers)):
        shown = ", ".join(map(str, sorted(blocks)[:3])) + (", ..." if len(blocks) > 3 else "")
        header.invalid(f"{arch}.block_count = {layers}, but the file holds tensors of {len(blocks)} blocks ({shown})")
    tokens = len(gguf.metadata.get("tokenizer.ggml.tokens", []))
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": header.count("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": header.real("attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": tokens or header.count("vocab_size"),
        "rope_theta": header.real("rope.freq_base", 10000.0),
        "rope_traditional": False,
        "max_position_embeddings": header.count("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    if spec.model_type not in ("phi3", "gemma3_text") and header.raw("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gguf.path}: partial RoPE ({arch}.rope.dimension_count < head size) is not supported for {arch}")
    config.update(spec.extra_config(header, gguf, config))
    return config


def hf_name(gguf: GGUFFile, spec: Architecture, gguf_name: str) -> Optional[str]:
    """The mlx-lm parameter name of a GGUF tensor; None for a tensor folded into the config."""
    if gguf_name in _CONFIG_TENSORS:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.layer_names:
        return f"model.layers.{parts[1]}.{spec.layer_names[parts[2]]}.{suffix}"
    raise UnsupportedModelError(f"{gguf.path}: unexpected tensor {gguf_name!r} for a {spec.model_type} model")


def unpermute_rows(gguf: GGUFFile, name: str, w: Any, n_heads: int, head_dim: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE layout)."""
    rows = w.shape[0]
    if rows != n_heads * head_dim:
        raise ModelLoadError(
            f"{gguf.path}: invalid GGUF header: tensor {name!r} has {rows} rows, but the header's "
            f"{n_heads} heads of {head_dim} need {n_heads * head_dim}"
        )
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
