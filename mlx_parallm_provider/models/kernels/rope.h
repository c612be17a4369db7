// RoPE's arithmetic, shared by the RoPE primitive (norm_rope.cpp) and the fused attention
// step (decode_attention.cpp), so both rotate bit for bit as mx.fast.rope's fallback does:
// theta = (t + offset) * scale * inv_freq[i], pairs (i, i + dims/2) or, when traditional,
// (2i, 2i + 1); the dimensions past `dims` pass through.
#pragma once

#include <cmath>
#include <cstdint>

namespace mlx_parallm {

// cos and sin of the `half` angles at `position` ((t + offset) * scale).
inline void rope_angles(float position, int half, const float* inv_freq, int64_t freq_stride, float* cs, float* sn) {
  for (int i = 0; i < half; i++) {
    float theta = position * inv_freq[i * freq_stride];
    cs[i] = std::cos(theta);
    sn[i] = std::sin(theta);
  }
}

// One head of `d` values from `src` (`stride` apart) rotated into `dst` (contiguous).
inline void rope_rotate(const float* src, int64_t stride, float* dst, int d, int dims, bool traditional, const float* c,
                        const float* s) {
  int half = dims / 2, step = traditional ? 2 : 1, other = traditional ? 1 : half;  // x1 at i * step, x2 at i * step + other
  for (int i = 0; i < half; i++) {
    int j1 = i * step, j2 = i * step + other;
    float x1 = src[j1 * stride], x2 = src[j2 * stride];
    float a = x1 * c[i], bb = x2 * s[i], e = x1 * s[i], f = x2 * c[i];
    dst[j1] = a - bb;
    dst[j2] = e + f;
  }
  for (int j = dims; j < d; j++) dst[j] = src[j * stride];
}

}  // namespace mlx_parallm
