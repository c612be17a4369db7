// RMSNorm and RoPE as fused MLX primitives (CPU), for steps of a few rows.
//
// On the CPU, mx.fast.rms_norm and mx.fast.rope run their fallbacks: graphs of 6 and ~15
// small ops (~35 and ~90 us a call at one row, mostly per-op dispatch). Each of these is one
// op. Semantics follow mlx/fast.cpp's fallbacks, in float32 only (callers route other dtypes
// to mx.fast): rms_norm = x * rsqrt(mean(x^2) + eps) * w; rope rotates the first `dims` of
// the last axis by theta = (t + offset) * scale * inv_freq, pairs (i, i + dims/2) or, when
// traditional, (2i, 2i + 1); the rest passes through. inv_freq is an input computed with
// MLX's own ops (mlx_parallm_provider/models/fused_ops.py), so it is bit-identical to theirs.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_primitive.h"
#include "rope.h"
#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlx_parallm {

// One row of RMSNorm: dst = src * rsqrt(mean(src^2) + eps) * w (strides in elements).
void rms_norm_row(const float* src, int64_t xs, const float* w, int64_t ws, int d, float eps, float* dst) {
  float sum = 0.0f;
  for (int i = 0; i < d; i++) sum += src[i * xs] * src[i * xs];
  float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int i = 0; i < d; i++) dst[i] = (src[i * xs] * inv) * w[i * ws];
}

namespace {

// Offset of row `row` (of `width` elements along the last axis) in `a`, in elements.
int64_t row_loc(const mx::array& a, size_t row, int width) {
  return mx::elem_to_loc(static_cast<int64_t>(row) * width, a.shape(), a.strides());
}

class RMSNormCPU : public mx::Primitive {
 public:
  RMSNormCPU(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = cpu_encoder(stream(), inputs, out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                      out = mx::array::unsafe_weak_copy(out), eps = eps_]() mutable {
      int d = x.shape(-1);
      size_t rows = d ? x.size() / d : 0;
      int64_t xs = x.strides().back(), ws = w.strides().back();
      const float* xd = x.data<float>();
      const float* wd = w.data<float>();
      float* o = out.data<float>();
      for (size_t r = 0; r < rows; r++) rms_norm_row(xd + row_loc(x, r, d), xs, wd, ws, d, eps, o + r * d);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("RMSNormCPU has no GPU implementation (CPU only)");
  }

  const char* name() const override { return "RMSNormCPU"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNormCPU&>(other).eps_;
  }

 private:
  float eps_;
};

class RoPECPU : public mx::Primitive {
 public:
  RoPECPU(mx::Stream stream, int dims, bool traditional, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = cpu_encoder(stream(), inputs, out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), offset = mx::array::unsafe_weak_copy(inputs[1]),
                      inv_freq = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
                      dims = dims_, traditional = traditional_, scale = scale_]() mutable {
      int d = x.shape(-1), t_len = x.shape(-2), batch = x.shape(0), half = dims / 2;
      size_t rows = d ? x.size() / d : 0;
      if (rows == 0) return;
      size_t rows_per_batch = rows / batch;
      size_t n_offsets = offset.size();
      // cos and sin per (offset row, position, frequency), as the fallback computes them.
      std::vector<float> cs(n_offsets * t_len * half), sn(cs.size());
      const int32_t* off = offset.data<int32_t>();
      const float* freq = inv_freq.data<float>();
      int64_t fs = inv_freq.strides().back();
      for (size_t b = 0; b < n_offsets; b++) {
        float start = static_cast<float>(off[mx::elem_to_loc(static_cast<int64_t>(b), offset.shape(), offset.strides())]);
        for (int t = 0; t < t_len; t++) {
          size_t at = (b * t_len + t) * half;
          rope_angles((static_cast<float>(t) + start) * scale, half, freq, fs, cs.data() + at, sn.data() + at);
        }
      }
      int64_t xs = x.strides().back();
      const float* xd = x.data<float>();
      float* o = out.data<float>();
      for (size_t r = 0; r < rows; r++) {
        size_t b = n_offsets == 1 ? 0 : r / rows_per_batch;
        int t = static_cast<int>(r % t_len);
        size_t at = (b * t_len + t) * half;
        rope_rotate(xd + row_loc(x, r, d), xs, o + r * d, d, dims, traditional, cs.data() + at, sn.data() + at);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("RoPECPU has no GPU implementation (CPU only)");
  }

  const char* name() const override { return "RoPECPU"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPECPU&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

}  // namespace

// mx.fast.rms_norm(x, w, eps) for float32 x and w (D,). Returns float32.
mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || w.ndim() != 1 || w.size() != static_cast<size_t>(x.shape(-1)) ||
      !mx::issubdtype(w.dtype(), mx::floating)) {
    throw std::invalid_argument("rms_norm: x must be float32 (..., D) and weight floating (D,)");
  }
  auto stream = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNormCPU>(stream, eps),
                   {x, mx::astype(w, mx::float32, stream)});
}

// mx.fast.rope(x, dims, traditional=..., base=..., scale=..., offset=...) for float32 x
// (B, ..., T, D), offset an integer array of 1 or B elements, inv_freq (dims / 2,) float32.
mx::array rope_op(const mx::array& x, int dims, bool traditional, float scale, const mx::array& offset,
                  const mx::array& inv_freq) {
  if (x.ndim() < 3 || x.dtype() != mx::float32) {
    throw std::invalid_argument("rope: x must be float32 with at least 3 dimensions");
  }
  if (dims <= 0 || dims % 2 || dims > x.shape(-1) || inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2 ||
      inv_freq.dtype() != mx::float32) {
    throw std::invalid_argument("rope: dims must be even, <= the last axis, and inv_freq (dims / 2,) float32 (dims=" +
                                std::to_string(dims) + ")");
  }
  if (offset.ndim() > 1 || (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))) ||
      !mx::issubdtype(offset.dtype(), mx::integer)) {
    throw std::invalid_argument("rope: offset must be an integer scalar or vector of one element per batch row");
  }
  auto stream = cpu_stream();
  auto off = offset.dtype() == mx::int32 ? offset : mx::astype(offset, mx::int32, stream);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPECPU>(stream, dims, traditional, scale),
                   {x, off, inv_freq});
}

}  // namespace mlx_parallm
