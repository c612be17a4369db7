"""The GGUF's tokenizer metadata -> ``tokenizer.json`` + ``tokenizer_config.json``.

Two tokenizer models are supported: ``gpt2`` (byte-level BPE with the file's merges, built
here) and ``llama`` (SentencePiece: tokens + scores + token types, built by transformers'
own GGUF tokenizer conversion, which rebuilds the merges from the vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...errors import UnsupportedModelError
from .chat_templates import fallback_chat_template

SUPPORTED_TOKENIZERS = ("gpt2", "llama")

# llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre` (see llama-vocab.cpp).
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRE = {"gpt-2", "gpt2", "default", "phi-2", "jina-es", "jina-de", "jais", "olmo", "dbrx"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "smaug-bpe"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
# Control tokens that end a turn, stopping generation as in llama.cpp (llama-vocab.cpp's EOG set).
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")


def tokenizer_files(path: Path, metadata: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokenizer.json, tokenizer_config.json)`` contents for the file's tokenizer."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer_json = _byte_level_bpe(path, metadata)
    elif model == "llama":
        tokenizer_json = _sentencepiece(path, metadata)
    else:
        raise UnsupportedModelError(
            f"{path}: tokenizer model {model!r} is not supported "
            "(supported: gpt2 byte-level BPE, llama SentencePiece)"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])

    def token_at(key: str) -> Optional[str]:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama"))
    bos = token_at("bos_token_id")
    if add_bos and bos is not None:
        bos_id = int(metadata["tokenizer.ggml.bos_token_id"])
        tokenizer_json["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    arch = metadata.get("general.architecture")
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": int(metadata.get(f"{arch}.context_length", 2048)),
        "bos_token": bos,
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "additional_special_tokens": [t["content"] for t in tokenizer_json["added_tokens"] if t["special"]],
    }
    chat_template = metadata.get("tokenizer.chat_template") or fallback_chat_template(arch)
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer_json, tokenizer_config


def stop_token_ids(metadata: dict[str, Any]) -> list[int]:
    """EOS, plus the end-of-turn tokens llama.cpp also stops on (Gemma's ``<end_of_turn>``)."""
    tokens = list(metadata.get("tokenizer.ggml.tokens", []))
    types = metadata.get("tokenizer.ggml.token_type")
    types = list(types) if types is not None else [1] * len(tokens)
    ids = [int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata]
    ids += [i for i, (token, kind) in enumerate(zip(tokens, types)) if kind == 3 and token in _END_OF_TURN]
    return sorted(set(i for i in ids if 0 <= i < len(tokens)), key=ids.index)


def _sentencepiece(path: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    import json

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:
        raise UnsupportedModelError(
            f"{path}: a SentencePiece GGUF tokenizer needs transformers >= 5 (its GGUF tokenizer conversion): {exc}"
        ) from None
    keys = {"tokens": "tokens", "scores": "scores", "token_type": "token_type", "merges": "merges",
            "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
            "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}
    spec: dict[str, Any] = {"tokenizer_type": "llama"}
    for key, name in keys.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            spec[name] = value.tolist() if hasattr(value, "tolist") else value
    backend, _ = convert_gguf_tokenizer(metadata.get("general.architecture"), spec)
    return json.loads(backend.to_str())


def _byte_level_bpe(path: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else [1] * len(tokens)
    merges = [m.split(" ", 1) for m in metadata.get("tokenizer.ggml.merges", [])]
    # token_type 3 = control (special), 4 = user-defined (added but not special).
    added_tokens = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": kind != 3, "special": kind == 3}
        for i, kind in enumerate(token_types)
        if kind in (3, 4)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(path, metadata.get("tokenizer.ggml.pre", "default")),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }


def _pre_tokenizer(path: Path, pre: str) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    if pre in _SPLIT_DIGITS_PRE:
        regexes = [r"\p{N}", _GPT2_REGEX]
    elif pre in _GPT2_PRE:
        regexes = [_GPT2_REGEX]
    elif pre in _LLAMA3_PRE:
        regexes = [_LLAMA3_REGEX]
    elif pre in _QWEN2_PRE:
        regexes = [_QWEN2_REGEX]
    else:
        raise UnsupportedModelError(f"{path}: tokenizer pre-tokenizer {pre!r} is not supported")
    splits = [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False} for regex in regexes]
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}
