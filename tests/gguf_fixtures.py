"""Builds small GGUF files for tests: a tiny llama written the way llama.cpp lays it out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def permute_for_gguf(w: Any, n_heads: int) -> Any:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (half-split -> interleaved)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors_from_hf(params: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Rename Hugging Face llama tensors to GGUF names, permuting Q and K as llama.cpp does."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = value
        elif name == "model.norm.weight":
            out["output_norm.weight"] = value
        elif name == "lm_head.weight":
            out["output.weight"] = value
        else:
            _, _, layer, *rest = name.split(".")
            module, suffix = ".".join(rest[:-1]), rest[-1]
            if module == "self_attn.q_proj":
                value = permute_for_gguf(value, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                value = permute_for_gguf(value, config["num_key_value_heads"])
            out[f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"] = value
    return out


def write_llama_gguf(
    path: Path, params: dict[str, Any], config: dict[str, Any], tokenizer_meta: dict[str, Any], architecture: str = "llama",
    header: Optional[dict[str, Any]] = None,
) -> Path:
    """Write a GGUF of a llama model from HF-named ``params`` plus tokenizer metadata.
    ``header`` replaces metadata values by key, after the architecture (``{"attention.head_count":
    0}`` writes ``llama.attention.head_count = 0``); an int is written as uint32, None drops the key."""
    import mlx.core as mx

    def u32(v: int) -> Any:
        return mx.array(v, dtype=mx.uint32)

    metadata = {
        "general.architecture": architecture,
        f"{architecture}.embedding_length": u32(config["hidden_size"]),
        f"{architecture}.block_count": u32(config["num_hidden_layers"]),
        f"{architecture}.feed_forward_length": u32(config["intermediate_size"]),
        f"{architecture}.attention.head_count": u32(config["num_attention_heads"]),
        f"{architecture}.attention.head_count_kv": u32(config["num_key_value_heads"]),
        f"{architecture}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        f"{architecture}.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        f"{architecture}.context_length": u32(config["max_position_embeddings"]),
        **tokenizer_meta,
    }
    for key, value in (header or {}).items():
        key = f"{architecture}.{key}"
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = u32(value) if isinstance(value, int) else value
    mx.save_gguf(str(path), gguf_tensors_from_hf(params, config), metadata)
    return path


def tokenizer_metadata(gguf_path: Path) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of an existing GGUF file."""
    import mlx.core as mx

    _, metadata = mx.load(str(gguf_path), return_metadata=True)
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}
