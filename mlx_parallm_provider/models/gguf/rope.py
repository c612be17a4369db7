"""RoPE scaling stored in a GGUF -> the ``rope_scaling`` of an mlx-lm config."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

# Llama 3.1 / 3.2's original context. Any other value with matching low / high factors gives
# the same frequencies (the formula depends only on their ratios), so it is a free choice.
_LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_scaling(factors: np.ndarray, base: float, dims: int) -> Optional[dict[str, Any]]:
    """Recover ``{"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}`` from llama.cpp's ``rope_freqs`` tensor (the divisor of
    each rotary frequency, written by convert_hf_to_gguf from those four numbers).

    Returns None when the tensor is not of that form (checked by recomputing it)."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.size != dims // 2 or not np.isfinite(factors).all() or factors.min() <= 0:
        return None
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    length = _LLAMA3_ORIGINAL_CONTEXT
    smooth = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if smooth.sum() >= 2:
        # 1 / r = 1 / f + s (1 - 1 / f), with s = (L / wavelen - low) / (high - low), linear in 1 / wavelen.
        s = (1 / factors[smooth] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelens[smooth], s, 1)
        low = -intercept * length / slope
        high = low + length / slope
    else:  # no band of smoothed frequencies to fit: try Llama 3.1's own numbers
        low, high = 1.0, 4.0
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(float(low), 6),
        "high_freq_factor": round(float(high), 6),
        "original_max_position_embeddings": length,
    }
    if not np.allclose(_llama3_factors(scaling, base, dims), factors, rtol=1e-4):
        return None
    return scaling


def _llama3_factors(scaling: dict[str, Any], base: float, dims: int) -> np.ndarray:
    """The divisors mlx-lm's ``Llama3RoPE`` applies (its formula, in numpy)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    length = scaling["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (length / wavelens - low) / (high - low)
    medium = (wavelens > length / high) & (wavelens < length / low)
    out = np.where(wavelens > length / low, factor, 1.0)
    return np.where(medium, 1 / ((1 - smooth) / factor + smooth), out)
