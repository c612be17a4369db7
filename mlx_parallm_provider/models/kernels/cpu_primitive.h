// What the extension's CPU primitives (qmatmul_ext.cpp, norm_rope.cpp) share.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
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

// A CPU-only primitive with one output shaped as its first input, whose eval hands weak
// copies of the inputs and a copy of Self's `params` to Self::run(inputs, out, params) on
// the stream (the attention primitives, the decoder-layer op).
template <class Self>
class CpuPrimitive : public mlx::core::Primitive {
 public:
  using mlx::core::Primitive::Primitive;

  void eval_cpu(const std::vector<mlx::core::array>& inputs, std::vector<mlx::core::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = cpu_encoder(stream(), inputs, out);
    std::vector<mlx::core::array> in;
    for (auto& a : inputs) in.push_back(mlx::core::array::unsafe_weak_copy(a));
    encoder.dispatch([in = std::move(in), out = mlx::core::array::unsafe_weak_copy(out),
                      p = static_cast<const Self*>(this)->params]() mutable { Self::run(in, out, p); });
  }

  void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string(name()) + " has no GPU implementation (CPU only)");
  }

  std::vector<mlx::core::Shape> output_shapes(const std::vector<mlx::core::array>& inputs) override {
    return {inputs[0].shape()};
  }

  bool is_equivalent(const mlx::core::Primitive& other) const override {
    return static_cast<const Self*>(this)->params == static_cast<const Self&>(other).params;
  }
};

}  // namespace mlx_parallm
