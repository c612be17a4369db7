// What the extension's CPU primitives (qmatmul_ext.cpp, norm_rope.cpp) share.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_parallm {

// The default stream when it is on the CPU, else the CPU's: these ops have no GPU kernels.
inline mlx::core::Stream cpu_stream() {
  auto stream = mlx::core::to_stream({});
  return stream.device == mlx::core::Device::cpu ? stream : mlx::core::default_stream(mlx::core::Device::cpu);
}

// Allocates `out` and returns `stream`'s CPU encoder with `inputs` and `out` registered, as
// MLX's own CPU ops do (the encoder keeps them alive until the dispatched task has run).
// Dispatch after this call: a task's weak copy of `out` must see its allocated buffer.
inline mlx::core::cpu::CommandEncoder& cpu_encoder(const mlx::core::Stream& stream,
                                                   const std::vector<mlx::core::array>& inputs,
                                                   mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  return encoder;
}

// The array's bytes in row-major order: its own buffer when row-contiguous, else `copy`
// filled with them.
inline const char* row_major(const mlx::core::array& a, std::vector<char>& copy) {
  if (a.flags().row_contiguous) {
    return a.data<char>();
  }
  size_t item = a.itemsize();
  copy.resize(a.size() * item);
  const char* src = a.data<char>();
  for (size_t i = 0; i < a.size(); i++) {
    int64_t loc = mlx::core::elem_to_loc(static_cast<int64_t>(i), a.shape(), a.strides());
    std::memcpy(copy.data() + i * item, src + loc * item, item);
  }
  return copy.data();
}

}  // namespace mlx_parallm
