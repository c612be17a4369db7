// The fused attention step (decode_attention.cpp) as its two ops use it: PagedAttentionStepCPU
// and the decoder-layer op (decoder_layer.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"

namespace mlx_parallm {

struct StepParams {
  float scale, rope_scale;
  int block_size, threads, heads, rope_dims;
  bool traditional;
  bool operator==(const StepParams& o) const {
    return scale == o.scale && rope_scale == o.rope_scale && block_size == o.block_size && threads == o.threads &&
           heads == o.heads && rope_dims == o.rope_dims && traditional == o.traditional;
  }
};

// The step's seven inputs as its ops hold them, checked: k_pool and v_pool (N, KVH, D), both
// float32 or both float16 (or both quantized: uint32 codes (N, KVH, D * bits / 32), bits 8 or 4,
// and `scales` [K scales, K biases, V scales, V biases] float16 (N, KVH, D / 32), the step's
// inputs 7 to 10; written as storage.py writes them, bit for bit), with p.heads query heads a KV head group at most 16, D a multiple of
// 16 up to 256; slots (B * L,), table (B, M), limits (B,) for L = 1 or (B, L), offset (B,)
// (int32, row-contiguous); inv_freq (p.rope_dims / 2,) float32, rope_dims even and at most D.
// Throws std::invalid_argument, its message beginning with `op`.
std::vector<mlx::core::array> step_inputs(const char* op, int B, int L, const StepParams& p, const mlx::core::array& k_pool,
                                          const mlx::core::array& v_pool, const mlx::core::array& slots,
                                          const mlx::core::array& table, const mlx::core::array& limits,
                                          const mlx::core::array& offset, const mlx::core::array& inv_freq,
                                          const mlx::core::Stream& stream,
                                          const std::optional<std::vector<mlx::core::array>>& scales = std::nullopt);

// The real positions of a row of a right-padded pass with L positions a row, from its limits
// (L of them): a real position sees one token more than the one before it; padding repeats
// the last real one's limit. At least 1.
inline int real_positions(const int32_t* limits, int L) {
  int n = 1;
  while (n < L && limits[n] > limits[n - 1]) n++;
  return n;
}

// The step over raw rows: row r = b * L + j of q (heads * D floats), k and v (KVH * D) at
// q_rows[r], k_rows[r], v_rows[r]; `step` the seven arrays step_inputs gave; the new K/V are
// written into the pools in place; out (B, L, heads * D).
void attention_step_rows(const float* const* q_rows, const float* const* k_rows, const float* const* v_rows,
                         const mlx::core::array* step, int B, int L, const StepParams& p, float* out);

}  // namespace mlx_parallm
