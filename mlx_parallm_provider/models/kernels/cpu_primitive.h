// What the extension's CPU primitives (qmatmul_ext.cpp, norm_rope.cpp) share.
#pragma once

#include <vector>

#include "mlx/allocator.h"
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

}  // namespace mlx_parallm
