"""Tiny GGUF files written with gguf-py's GGUFWriter: random weights in GGML block types
(raw blocks, byte for byte, with finite float16 scales), small vocabularies, a few layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Byte offsets of the float16 fields of each block type (the rest of a block is any bytes).
_HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_tensor(type_name: str, shape: tuple[int, int], rng: np.random.Generator, scale: float) -> tuple[np.ndarray, Any]:
    """``(data, GGML type)`` for ``GGUFWriter.add_tensor``: random valid blocks of ``type_name``
    whose weights are of the order of ``scale``, or a float array for F32 / F16 / BF16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType[type_name]
    if type_name in ("F32", "F16"):
        return (rng.standard_normal(shape) * scale).astype(np.float32 if type_name == "F32" else np.float16), kind
    if type_name == "BF16":
        bits = (rng.standard_normal(shape) * scale).astype(np.float32).view(np.uint32)
        return (bits >> 16).astype(np.uint16).view(np.uint8).reshape(shape[0], -1), kind
    block, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // block, size), dtype=np.uint8)
    # A block's scale times its largest code (63 for 6-bit sub-scales, 15-127 for codes) is ~scale.
    per_code = {"Q8_0": 1 / 128, "Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31}.get(type_name, 1 / 500)
    for at in _HALF_FIELDS[type_name]:
        halves = (rng.uniform(0.5, 1.0, size=len(blocks)) * scale * per_code).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1), kind


def byte_level_vocab() -> dict[str, Any]:
    """A 262-token byte-level BPE tokenizer (the 256 bytes, a few merges, ChatML specials)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = byte_tokens + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    return {"model": "gpt2", "pre": "gpt2", "tokens": tokens, "types": types, "merges": merges,
            "bos": len(tokens) - 3, "eos": len(tokens) - 1, "template": template}


def sentencepiece_vocab() -> dict[str, Any]:
    """A Gemma-style SentencePiece vocabulary: specials, byte fallback, a few pieces, no template."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "▁the", "▁cat", "▁sat", "▁on", "▁mat", "th", "he", "at", "ca", "sa", "ma", "on", "▁t", "▁c", "▁s", "▁m", "▁o"]
    letters = list("abcdefghijklmnopqrstuvwxyzTHEC.,!?\n")
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces + letters
    types = [3] * len(specials) + [6] * 256 + [1] * (len(pieces) + len(letters))
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": [-float(i) for i in range(len(tokens))],
            "bos": 2, "eos": 1, "template": None}


def write_gguf(path: Path, arch: str, header: dict[str, Any], vocab: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Any]]) -> Path:
    """Write a GGUF of ``arch`` with ``header`` (key after the architecture -> int / float / str)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in header.items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_string(f"{arch}.{key}", value)
    writer.add_string("tokenizer.ggml.model", vocab["model"])
    writer.add_string("tokenizer.ggml.pre", vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", vocab["bos"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab["eos"])
    if vocab["template"]:
        writer.add_chat_template(vocab["template"])
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
