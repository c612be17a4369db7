// The Gumbel-max draw of sampled rows as one CPU op: argmax(row + gumbel noise), each row with
// its own PRNG key, the noise bit for bit what MLX's mx.random.gumbel(row.shape, key=key) makes.
//
// On x86 MLX's CPU draws a row's noise ~6 ns an element for the random bits (threefry, one
// element at a time) and twice more for its two logs: a 32-row draw over a 49,152-token
// vocabulary cost ~20 ms, a fifth of a sampled 32-row decode step of the default model. Here the
// bits are MLX's own (threefry2x32 over the counters MLX's RandomBits gives each word), the
// uniform is MLX's (the bits as float32, over 2^32, below 1), and -log(-log(u)) goes 16 lanes at a
// time through a cephes-style log (error ~1 ulp against MLX's): a row draws what MLX's draw gives
// it, but where two candidates' noisy scores tie within rounding.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_primitive.h"
#include "fast_exp.h"  // (the 16-lane vector types)
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace mlx_parallm {

extern "C" void qm_parallel_for(int items, int threads, void (*fn)(void*, int, int), void* ctx);  // qmatmul.c

namespace {

typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16u rotl(v16u x, int r) { return (x << r) | (x >> (32 - r)); }

// MLX's threefry2x32 (mlx/backend/cpu/threefry.cpp) of 16 counter pairs under one key.
inline void threefry16(uint32_t k0, uint32_t k1, v16u& a, v16u& b) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  static const int rotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  a += ks[0];
  b += ks[1];
  for (int i = 0; i < 5; i++) {
    for (int r : rotations[i % 2]) {
      a += b;
      b = rotl(b, r);
      b ^= a;
    }
    a += ks[(i + 1) % 3];
    b += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
}

// log(x) for 16 positive normal floats (cephes' logf: the mantissa reduced to [sqrt(1/2), sqrt(2)),
// a degree-8 polynomial; ~1 ulp); +inf stays +inf.
inline v16f log16(v16f x) {
  v16i bits = reinterpret_cast<v16i&>(x);
  v16i e = ((bits >> 23) & 0xff) - 126;
  v16i mbits = (bits & 0x007fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  v16f m = reinterpret_cast<v16f&>(mbits);
  v16i small = m < 0.70710678118654752440f;  // -1 where below sqrt(1/2)
  e += small;
  m = m + (small ? m : v16f{}) - 1.0f;  // 2m - 1 or m - 1
  v16f ef = __builtin_convertvector(e, v16f);
  v16f z = m * m;
  v16f y = v16f{} + 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * ef;
  y += -0.5f * z;
  v16f r = m + y + 0.693359375f * ef;
  v16i inf = x == __builtin_inff();
  return inf ? x : r;
}

// MLX's uniform in [0, 1) from random bits: float32(bits) / 2^32, at most the float below 1.
inline v16f uniform16(v16u bits) {
  v16f u = __builtin_convertvector(bits, v16f) * 2.3283064365386963e-10f;
  const v16f below_one = v16f{} + 0.99999994f;
  return u > below_one ? below_one : u;
}

// -log(-log(u)): -inf where u is 0.
inline v16f gumbel16(v16f u) {
  v16i zero = u == 0.0f;
  v16f g = -log16(-log16(zero ? v16f{} + 1.0f : u));
  return zero ? v16f{} - __builtin_inff() : g;
}

// The best score of 16 lanes so far and its index, where scores come in index order lane by lane
// (so a strict > keeps a lane's first maximum); NaN scores are taken aside, the lowest index.
struct Best {
  v16f score = v16f{} - __builtin_inff();
  v16i at = v16i{} - 1;
  int nan_at = -1;

  void take(v16f s, v16i idx, int count) {
    if (count < 16) {  // (a tail: its unused lanes never win)
      for (int l = count; l < 16; l++) s[l] = -__builtin_inff();
    }
    v16i nan = s != s;
    for (int l = 0; l < count; l++) {
      if (nan[l] && (nan_at < 0 || idx[l] < nan_at)) nan_at = idx[l];
    }
    v16i better = (s > score) | ((s == score) & (at < 0));
    score = better ? s : score;
    at = better ? idx : at;
  }
};

// A row's draw. Its words are MLX's RandomBits for one key: at j < half, threefry(key, (j, j +
// half + odd)).first, and .second at j + half + odd; for odd V, threefry(key, (half, 0)).first at
// half. Ties go to the lower index and a NaN score wins, as MLX's argmax takes them.
uint32_t draw_row(const float* row, int V, uint32_t k0, uint32_t k1) {
  const int half = V / 2, odd = V % 2;
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float* upper = row + half + odd;
  Best lo, hi;  // the first half's tokens, the second's (each in index order)
  for (int j = 0; j < half; j += 16) {
    int n = std::min(16, half - j);
    v16i idx = lane + j;
    v16u a = reinterpret_cast<const v16u&>(idx), b = a + static_cast<uint32_t>(half + odd);
    threefry16(k0, k1, a, b);
    v16f x, y;
    if (n == 16) {
      x = *reinterpret_cast<const v16f_u*>(row + j), y = *reinterpret_cast<const v16f_u*>(upper + j);
    } else {
      x = v16f{}, y = v16f{};
      for (int l = 0; l < n; l++) x[l] = row[j + l], y[l] = upper[j + l];
    }
    lo.take(x + gumbel16(uniform16(a)), idx, n);
    hi.take(y + gumbel16(uniform16(b)), idx + (half + odd), n);
  }
  if (odd) {
    v16u c = v16u{} + static_cast<uint32_t>(half), d = v16u{};
    threefry16(k0, k1, c, d);
    lo.take(v16f{} + row[half] + gumbel16(uniform16(c)), v16i{} + half, 1);  // (above every index of the first half)
  }
  float best = -__builtin_inff();
  int best_at = -1, nan_at = -1;
  for (const Best* part : {&lo, &hi}) {
    if (part->nan_at >= 0 && (nan_at < 0 || part->nan_at < nan_at)) nan_at = part->nan_at;
    for (int l = 0; l < 16; l++) {
      int at = part->at[l];
      float s = part->score[l];
      if (at >= 0 && (best_at < 0 || s > best || (s == best && at < best_at))) best = s, best_at = at;
    }
  }
  return static_cast<uint32_t>(nan_at >= 0 ? nan_at : best_at >= 0 ? best_at : 0);
}

struct Rows {
  const float* rows;
  const uint32_t* keys;
  uint32_t* out;
  int V;
};

void draw_rows(void* ctx, int i0, int i1) {
  const Rows& r = *static_cast<const Rows*>(ctx);
  for (int i = i0; i < i1; i++) r.out[i] = draw_row(r.rows + static_cast<int64_t>(i) * r.V, r.V, r.keys[2 * i], r.keys[2 * i + 1]);
}

struct DrawParams {
  int threads;
  bool operator==(const DrawParams& o) const { return threads == o.threads; }
};

class GumbelDrawCPU : public mx::Primitive {
 public:
  GumbelDrawCPU(mx::Stream stream, DrawParams p) : mx::Primitive(stream), params(p) {}

  DrawParams params;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = cpu_encoder(stream(), inputs, out);
    encoder.dispatch([rows = mx::array::unsafe_weak_copy(inputs[0]), keys = mx::array::unsafe_weak_copy(inputs[1]),
                      out = mx::array::unsafe_weak_copy(out), p = params]() mutable {
      std::vector<char> row_copy, key_copy;
      const float* r = reinterpret_cast<const float*>(row_major(rows, row_copy));
      const uint32_t* k = reinterpret_cast<const uint32_t*>(row_major(keys, key_copy));
      int n = rows.shape(0), V = rows.shape(1);
      uint32_t* o = out.data<uint32_t>();
      Rows ctx{r, k, o, V};
      int threads = std::min(p.threads, n);
      if (threads <= 1) {
        draw_rows(&ctx, 0, n);
      } else {
        qm_parallel_for(n, threads, draw_rows, &ctx);  // (the packed-weight kernel's pool of helpers)
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("GumbelDrawCPU has no GPU implementation (CPU only)");
  }

  const char* name() const override { return "GumbelDrawCPU"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {{inputs[0].shape(0)}}; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return params == static_cast<const GumbelDrawCPU&>(other).params;
  }
};

}  // namespace

// Each row's argmax(rows[i] + mx.random.gumbel((V,), key=keys[i])): rows (n, V) float32, keys
// (n, 2) uint32. Returns (n,) uint32.
mx::array gumbel_draw_op(const mx::array& rows, const mx::array& keys, int threads) {
  if (rows.dtype() != mx::float32 || rows.ndim() != 2 || rows.shape(1) < 1 || keys.dtype() != mx::uint32 ||
      keys.shape() != mx::Shape{rows.shape(0), 2}) {
    throw std::invalid_argument("gumbel_draw: rows must be float32 (n, V) and keys uint32 (n, 2)");
  }
  return mx::array({rows.shape(0)}, mx::uint32, std::make_shared<GumbelDrawCPU>(cpu_stream(), DrawParams{std::max(threads, 1)}),
                   {rows, keys});
}

}  // namespace mlx_parallm
