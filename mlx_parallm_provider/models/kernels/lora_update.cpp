// Each row's LoRA update of a linear layer's output as one CPU op (models/lora/layers.py):
//   out[b, l] = y[b, l] + scale[b] * ((x[b, l] @ A[slot[b]]) @ B[slot[b]])
// for float32 y (B, L, N), x (B, L, K), A transposed (S, R, K), B (S, R, N), slot (B,) uint32,
// scale (B,).
//
// Two mx.gather_mm, a multiply and an add cost a 32-row step of the default model ~10 ms over
// its 112 adapted layers: MLX's CPU gather_mm runs a BLAS call per row, ~1.2 us each beside
// its work (R x (K + N) multiply-adds, a few thousand). Here a row's update is R dot products
// of K (8 at once, 16 lanes each), then 64 columns at a time R rows of B added in, rows shared
// out over the packed-weight kernel's thread pool. A row of slot 0 (no adapter: its pair is zeros) is y as it is.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_primitive.h"
#include "fast_exp.h"
#include "mlx/ops.h"

extern "C" void qm_parallel_for(int items, int threads, void (*fn)(void*, int, int), void* ctx);  // qmatmul.c

namespace mx = mlx::core;

namespace mlx_parallm {

namespace {

constexpr int kMaxRank = 256;

struct LoRAParams {
  int threads;
  bool operator==(const LoRAParams& o) const { return threads == o.threads; }
};

struct LoRAJob {
  const float *y, *x, *a, *b, *scale;
  const uint32_t* slot;
  float* out;
  int L, K, R, N, S;
  int64_t y_b, y_l, x_b, x_l;  // strides of y's and x's rows (each row's own elements contiguous)
};

// Rows [first, last) of B * L.
void lora_rows(void* ctx, int first, int last) {
  const LoRAJob& j = *static_cast<const LoRAJob*>(ctx);
  float t[kMaxRank];
  for (int row = first; row < last; row++) {
    int batch = row / j.L;
    uint32_t s = j.slot[batch];
    int pos = row % j.L;
    const float* yr = j.y + batch * j.y_b + pos * j.y_l;
    float* o = j.out + static_cast<size_t>(row) * j.N;
    if (s == 0 || s >= static_cast<uint32_t>(j.S)) {
      std::memcpy(o, yr, sizeof(float) * j.N);
      continue;
    }
    const float* xr = j.x + batch * j.x_b + pos * j.x_l;
    const float* a = j.a + static_cast<size_t>(s) * j.K * j.R;
    const float* b = j.b + static_cast<size_t>(s) * j.R * j.N;
    for (int r0 = 0; r0 < j.R; r0 += 8) {  // t = x @ A: 8 of A's rows of K at a time (A is handed over transposed)
      int rn = std::min(8, j.R - r0);
      v16f acc[8] = {};
      int k = 0;
      for (; k + 16 <= j.K; k += 16) {
        v16f xv = *reinterpret_cast<const v16f_u*>(xr + k);
        for (int r = 0; r < rn; r++) acc[r] += xv * *reinterpret_cast<const v16f_u*>(a + static_cast<size_t>(r0 + r) * j.K + k);
      }
      for (int r = 0; r < rn; r++) {
        const float* ar = a + static_cast<size_t>(r0 + r) * j.K;
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += acc[r][l];
        for (int kk = k; kk < j.K; kk++) sum += xr[kk] * ar[kk];
        t[r0 + r] = sum;
      }
    }
    float scale = j.scale[batch];
    int n = 0;
    for (; n + 64 <= j.N; n += 64) {  // out = y + scale * (t @ B), 64 columns at a time
      v16f z0{}, z1{}, z2{}, z3{};
      for (int r = 0; r < j.R; r++) {
        const float* br = b + static_cast<size_t>(r) * j.N + n;
        float tr = t[r];
        z0 += tr * *reinterpret_cast<const v16f_u*>(br);
        z1 += tr * *reinterpret_cast<const v16f_u*>(br + 16);
        z2 += tr * *reinterpret_cast<const v16f_u*>(br + 32);
        z3 += tr * *reinterpret_cast<const v16f_u*>(br + 48);
      }
      *reinterpret_cast<v16f_u*>(o + n) = *reinterpret_cast<const v16f_u*>(yr + n) + scale * z0;
      *reinterpret_cast<v16f_u*>(o + n + 16) = *reinterpret_cast<const v16f_u*>(yr + n + 16) + scale * z1;
      *reinterpret_cast<v16f_u*>(o + n + 32) = *reinterpret_cast<const v16f_u*>(yr + n + 32) + scale * z2;
      *reinterpret_cast<v16f_u*>(o + n + 48) = *reinterpret_cast<const v16f_u*>(yr + n + 48) + scale * z3;
    }
    for (; n < j.N; n++) {
      float z = 0.0f;
      for (int r = 0; r < j.R; r++) z += t[r] * b[static_cast<size_t>(r) * j.N + n];
      o[n] = yr[n] + scale * z;
    }
  }
}

class LoRAUpdate : public CpuPrimitive<LoRAUpdate> {
 public:
  LoRAUpdate(mx::Stream stream, LoRAParams p) : CpuPrimitive(stream), params(p) {}
  LoRAParams params;

  static void run(std::vector<mx::array>& in, mx::array& out, const LoRAParams& p) {
    std::vector<char> cy, cx, ca, cb, cs, cl;
    const mx::array &y = in[0], &x = in[1], &a = in[2], &b = in[3], &slot = in[4], &scale = in[5];
    auto f = [](const mx::array& v, std::vector<char>& copy) { return reinterpret_cast<const float*>(row_major(v, copy)); };
    // y is often a column slice of a shared q/k/v or gate/up output: read its rows in place.
    bool y_rows = y.strides(2) == 1, x_rows = x.strides(2) == 1;
    const float* yd = y_rows ? y.data<float>() : f(y, cy);
    const float* xd = x_rows ? x.data<float>() : f(x, cx);
    int L = x.shape(1), K = x.shape(2), N = y.shape(2);
    LoRAJob job{yd, xd, f(a, ca), f(b, cb), f(scale, cs), reinterpret_cast<const uint32_t*>(row_major(slot, cl)),
                out.data<float>(), L, K, a.shape(1), N, a.shape(0),
                y_rows ? y.strides(0) : int64_t{L} * N, y_rows ? y.strides(1) : int64_t{N},
                x_rows ? x.strides(0) : int64_t{L} * K, x_rows ? x.strides(1) : int64_t{K}};
    int rows = x.shape(0) * x.shape(1);
    // A decode step's update is a few hundred thousand multiply-adds: waking a second thread
    // cost more than it saved (32 rows of the default model: 0.93x); a prefill piece's pays.
    int64_t work = static_cast<int64_t>(rows) * job.R * (job.K + job.N);
    int threads = work >= (int64_t{1} << 22) ? p.threads : 1;
    if (threads <= 1 || rows < 2) {
      lora_rows(&job, 0, rows);
    } else {
      qm_parallel_for(rows, threads, lora_rows, &job);
    }
  }

  const char* name() const override { return "LoRAUpdate"; }
};

}  // namespace

// y + scale[b] * ((x @ a[slot[b]].T) @ b[slot[b]]) (see the file's comment). float32 out, y's shape.
mx::array lora_update_op(const mx::array& y, const mx::array& x, const mx::array& a, const mx::array& b,
                         const mx::array& slot, const mx::array& scale, int threads) {
  auto f32 = [](const mx::array& v) { return v.dtype() == mx::float32; };
  if (!f32(y) || !f32(x) || !f32(a) || !f32(b) || !f32(scale) || slot.dtype() != mx::uint32) {
    throw std::invalid_argument("lora_update: y, x, a, b and scale must be float32, slot uint32");
  }
  if (y.ndim() != 3 || x.ndim() != 3 || a.ndim() != 3 || b.ndim() != 3 || y.shape(0) != x.shape(0) ||
      y.shape(1) != x.shape(1) || x.shape(2) != a.shape(2) || a.shape(1) != b.shape(1) || b.shape(2) != y.shape(2) ||
      a.shape(0) != b.shape(0) || slot.size() != static_cast<size_t>(x.shape(0)) ||
      scale.size() != static_cast<size_t>(x.shape(0)) || a.shape(1) > kMaxRank) {
    throw std::invalid_argument("lora_update: expected y (B, L, N), x (B, L, K), a (S, R, K), b (S, R, N), slot and scale (B,), R <= 256");
  }
  return mx::array(y.shape(), mx::float32, std::make_shared<LoRAUpdate>(cpu_stream(), LoRAParams{std::max(threads, 1)}),
                   {y, x, a, b, slot, scale});
}

}  // namespace mlx_parallm
