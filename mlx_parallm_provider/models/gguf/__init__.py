"""Convert a GGUF file into an mlx-lm model folder.

The folder holds ``config.json``, ``model*.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the GGUF's chat template), so ``mlx_lm.load`` opens it like
any Hugging Face conversion. Quantized tensors stay quantized in MLX's affine layout
(:mod:`.tensors`); architectures: :data:`SUPPORTED_ARCHITECTURES` (:mod:`.architectures`);
tokenizers: byte-level BPE and SentencePiece (:mod:`.tokenizer`).
"""

from __future__ import annotations

from .architectures import ARCHITECTURES
from .convert import CONVERTER_VERSION, convert_gguf, read_gguf_tokenizer
from .tensors import SUPPORTED_TYPES

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_TENSOR_TYPES = SUPPORTED_TYPES

__all__ = ["CONVERTER_VERSION", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TENSOR_TYPES", "convert_gguf", "read_gguf_tokenizer"]
