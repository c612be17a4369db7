// SwiGLU (mlx-lm's swiglu: silu(gate) * x) as one fused MLX primitive (CPU), float32.
//
// MLX's CPU exp costs ~17 ns an element on x86, and models/cpu_ops.py's formulation of it from
// arithmetic ops, compiled, still ~6 ns (a 64-row step of the default model spent ~17 ms of
// ~230 in it). This is the same formulation (fast_exp.h's exp16: range reduction to 2^n * 2^f
// and a degree-6 polynomial for 2^f; relative error < 3e-7), 16 elements at a time:
// out = gate * x / (1 + exp(-gate)).
#include <stdexcept>
#include <vector>

#include "cpu_primitive.h"
#include "fast_exp.h"
#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlx_parallm {

// silu(g) * x over n contiguous elements, 16 at a time through exp16 (the tail through a
// padded vector); also the decoder-layer op's (decoder_layer.cpp).
void swiglu_rows(const float* g, const float* x, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f gv = *reinterpret_cast<const v16f_u*>(g + i), xv = *reinterpret_cast<const v16f_u*>(x + i);
    *reinterpret_cast<v16f_u*>(out + i) = gv * xv / (1.0f + exp16(-gv));
  }
  if (i < n) {
    v16f gv{}, xv{};
    for (size_t j = i; j < n; j++) gv[j - i] = g[j], xv[j - i] = x[j];
    v16f o = gv * xv / (1.0f + exp16(-gv));
    for (size_t j = i; j < n; j++) out[j] = o[j - i];
  }
}

namespace {

class SwiGLUCPU : public mx::Primitive {
 public:
  explicit SwiGLUCPU(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = cpu_encoder(stream(), inputs, out);
    encoder.dispatch([gate = mx::array::unsafe_weak_copy(inputs[0]), x = mx::array::unsafe_weak_copy(inputs[1]),
                      out = mx::array::unsafe_weak_copy(out)]() mutable {
      // Row by row: the gate and up halves of a fused gate/up matmul are column slices, whose
      // rows are contiguous but not the whole (an element-wise gather cost ~60 us a layer).
      int d = gate.ndim() ? gate.shape(-1) : 1;
      size_t rows = d ? gate.size() / d : 0;
      int64_t gs = gate.ndim() ? gate.strides().back() : 1, xs = x.ndim() ? x.strides().back() : 1;
      const float* g = gate.data<float>();
      const float* xd = x.data<float>();
      float* o = out.data<float>();
      for (size_t r = 0; r < rows; r++) {
        int64_t start = static_cast<int64_t>(r) * d;
        const float* gr = g + (gate.ndim() ? mx::elem_to_loc(start, gate.shape(), gate.strides()) : 0);
        const float* xr = xd + (x.ndim() ? mx::elem_to_loc(start, x.shape(), x.strides()) : 0);
        float* orow = o + start;
        if (gs == 1 && xs == 1) {
          swiglu_rows(gr, xr, orow, d);
        } else {  // (a transposed view) gathered into contiguous rows first
          std::vector<float> gc(d), xc(d);
          for (int i = 0; i < d; i++) gc[i] = gr[i * gs], xc[i] = xr[i * xs];
          swiglu_rows(gc.data(), xc.data(), orow, d);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("SwiGLUCPU has no GPU implementation (CPU only)");
  }

  const char* name() const override { return "SwiGLUCPU"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

// silu(gate) * x for float32 gate and x of the same shape. Returns float32.
mx::array swiglu_op(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape()) {
    throw std::invalid_argument("swiglu: gate and x must be float32 arrays of the same shape");
  }
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLUCPU>(cpu_stream()), {gate, x});
}

}  // namespace mlx_parallm
