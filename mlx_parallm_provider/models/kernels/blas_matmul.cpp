// x @ W.T through a cblas_sgemm that MLX itself does not link, as an MLX primitive.
//
// MLX's CPU matmuls bind to whichever cblas_sgemm was in the global symbol scope when libmlx
// loaded (its wheel bundles a reference BLAS). When mlx was imported before this package could
// put OpenBLAS there, models/private_blas.py loads OpenBLAS privately (RTLD_LOCAL) and hands
// this file its cblas_sgemm's address; the model's dense layers then multiply through it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_primitive.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace {

// cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), LP64 ints.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

std::atomic<Sgemm> g_sgemm{nullptr};

class BlasMatmul : public mx::Primitive {
 public:
  explicit BlasMatmul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = mlx_parallm::cpu_encoder(stream(), inputs, out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                      out = mx::array::unsafe_weak_copy(out), sgemm = g_sgemm.load()]() mutable {
      using mlx_parallm::row_major;
      std::vector<char> xc, wc;
      int k = x.shape(-1), n = w.shape(0);
      int m = static_cast<int>(k ? x.size() / k : 0);
      if (m == 0 || n == 0) return;
      if (k == 0) {
        std::fill(out.data<float>(), out.data<float>() + out.size(), 0.0f);
        return;
      }
      sgemm(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0f, reinterpret_cast<const float*>(row_major(x, xc)), k,
            reinterpret_cast<const float*>(row_major(w, wc)), k, 0.0f, out.data<float>(), n);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("BlasMatmul has no GPU implementation (CPU only)");
  }

  const char* name() const override { return "BlasMatmul"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

namespace mlx_parallm {

void set_sgemm(std::uintptr_t address) { g_sgemm.store(reinterpret_cast<Sgemm>(address)); }

bool has_sgemm() { return g_sgemm.load() != nullptr; }

void* sgemm_address() { return reinterpret_cast<void*>(g_sgemm.load()); }

// x (..., K) float32 @ w.T, w (N, K) float32: (..., N) float32, through the sgemm set.
mx::array blas_matmul_op(const mx::array& x, const mx::array& w) {
  if (g_sgemm.load() == nullptr) throw std::runtime_error("blas_matmul: no sgemm set (set_sgemm first)");
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("blas_matmul: x must be (..., K) and w (N, K)");
  }
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) throw std::invalid_argument("blas_matmul: float32 only");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<BlasMatmul>(cpu_stream()), {x, w});
}

}  // namespace mlx_parallm
