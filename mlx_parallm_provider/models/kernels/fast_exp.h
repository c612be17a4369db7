// exp for 16 floats at once from arithmetic only, shared by the extension's CPU kernels
// (decode_attention.cpp's softmax, swiglu.cpp): MLX's CPU exp costs ~17 ns an element on x86.
#pragma once

#include <cstdint>

namespace mlx_parallm {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));

// exp(x) for 16 floats from arithmetic only (as models/cpu_ops.py's fast_exp: relative error
// < 3e-7; exactly 0 far below the range, so exp(-inf) = 0).
inline v16f exp16(v16f x) {
  const v16f lo = v16f{} - 127.0f, hi = v16f{} + 127.0f;
  v16f y = x * 1.4426950408889634f;
  y = y < lo ? lo : y;  // also maps -inf to -127
  y = y > hi ? hi : y;
  v16f n = (y + 12582912.0f) - 12582912.0f;  // round to nearest integer
  v16f f = y - n;
  const float c[7] = {1.0f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                      0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f};
  v16f p = v16f{} + c[6];
  for (int i = 5; i >= 0; i--) p = p * f + c[i];
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  return p * reinterpret_cast<v16f&>(bits);
}

}  // namespace mlx_parallm
