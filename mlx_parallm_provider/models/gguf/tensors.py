"""GGUF tensors -> MLX arrays: quantized ones in MLX's affine layout, the rest as floats.

MLX's affine quantization stores, per group of 32 weights, ``w = scale * q + bias`` with
``q`` an unsigned ``bits``-bit code, packed least significant bit first into uint32 words.
Several GGML block types are exactly that (``EXACT``): their codes, scales and biases are
copied over (the scales and biases rounded to float16). GGML types whose scales cover
16 weights (Q2_K, Q3_K, Q6_K) do not fit MLX's smallest group of 32: they are dequantized
with gguf-py and quantized again (``REQUANTIZED``, with more bits than they had for Q6_K).
Rows are converted in chunks, so no tensor is ever held whole in float32.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

GROUP_SIZE = 32
_CHUNK_VALUES = 1 << 23  # weights converted at a time (32 MiB of float32)

# GGML type name -> MLX bits, for types whose blocks are affine groups of 32.
EXACT = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
# GGML type name -> MLX bits they are re-quantized to (dequantized by gguf-py first).
REQUANTIZED = {"Q2_K": 4, "Q3_K": 4, "Q6_K": 8}
FLOATS = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*FLOATS, *EXACT, *REQUANTIZED)


def convert(type_name: str, shape: tuple[int, ...], raw: np.ndarray) -> tuple[dict[str, Any], Optional[int]]:
    """Convert one tensor's raw bytes (rows, bytes per row) of GGML type ``type_name``.

    Returns ``({"weight": ..., "scales": ..., "biases": ...}, bits)`` for a quantized 2-D
    tensor, ``({"weight": array}, None)`` for a float one (1-D tensors always become float32).
    """
    import mlx.core as mx

    if type_name in FLOATS and type_name != "BF16":
        return {"weight": mx.array(raw.view(np.float32 if type_name == "F32" else np.float16).reshape(shape))}, None
    if type_name == "BF16":
        return {"weight": mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)}, None
    if len(shape) != 2:
        return {"weight": mx.array(_dequantize(type_name, raw).reshape(shape))}, None
    bits = EXACT.get(type_name) or REQUANTIZED[type_name]
    step = max(1, _CHUNK_VALUES // shape[1])
    parts = [_convert_rows(type_name, raw[i : i + step], bits) for i in range(0, shape[0], step)]
    weight, scales, biases = (np.concatenate(p) for p in zip(*parts))
    return {"weight": mx.array(weight), "scales": mx.array(scales), "biases": mx.array(biases)}, bits


def dequantize(type_name: str, shape: tuple[int, ...], raw: np.ndarray) -> np.ndarray:
    """gguf-py's float32 dequantization of a tensor (the reference the conversion is held to)."""
    return _dequantize(type_name, raw).reshape(shape)


def _dequantize(type_name: str, raw: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[type_name]).astype(np.float32)


def _convert_rows(type_name: str, raw: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = raw.shape[0]
    if type_name in EXACT:
        codes, scales, biases = _DECODERS[type_name](raw.reshape(-1, _BLOCK_BYTES[type_name]))
        codes = codes.reshape(rows, -1)
        return _pack(codes, bits), _half(scales.reshape(rows, -1)), _half(biases.reshape(rows, -1))
    import mlx.core as mx

    w, scales, biases = mx.quantize(mx.array(_dequantize(type_name, raw)), group_size=GROUP_SIZE, bits=bits)
    return np.array(w), _half(np.array(scales)), _half(np.array(biases))


def _half(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    return half if np.isfinite(half).all() else values.astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack (rows, cols) codes as MLX does: ``bits`` per code, least significant bit first."""
    rows, cols = codes.shape
    if bits in (4, 8):
        per_word = 32 // bits
        shifts = np.arange(per_word, dtype=np.uint32) * bits
        return (codes.reshape(rows, -1, per_word).astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)
    planes = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(rows, cols * bits), axis=-1, bitorder="little").view(np.uint32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0-style 16 bytes -> 32 codes: low nibbles are codes 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes -> 32 bits, bit k of the little-endian word for code k."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]


def _q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d


def _q5_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    return (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-block header -> per-sub-block scale ``d * sc`` and bias ``-dmin * m``."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    return _f16(b, 0) * sc.astype(np.float32), -_f16(b, 2) * m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: each 32-byte run holds two sub-blocks, low nibbles first."""
    runs = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> Decoded:
    scales, biases = _k_scales(b)
    return _k_nibbles(b[:, 16:144]), scales, biases


def _q5_k(b: np.ndarray) -> Decoded:
    scales, biases = _k_scales(b)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_nibbles(b[:, 48:176]) | (high.reshape(-1, 256) << 4), scales, biases


_DECODERS: dict[str, Callable[[np.ndarray], Decoded]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176}
