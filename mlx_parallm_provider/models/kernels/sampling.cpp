// Sampled rows' ops (CPU): their log-softmax, their top-p / min-p / top-k filters, their Gumbel-max draw, and
// the most likely tokens of rows that want top logprobs.
//
// The log-softmax is MLX's CPU x - logsumexp(x) where MLX's float SIMD width is 1 (x86, Linux ARM), bit for bit:
// MLX's exp there (mlx/backend/cpu/simd/math.h: a polynomial whose steps are fused multiply-adds) goes
// ~14 ns an element, a 32-row log-softmax over a 49,152-token vocabulary ~23 ms; here its exps go 16
// lanes at a time and only their sum keeps MLX's order (one float32 add after another).
//
// The filters are mlx-lm's apply_top_p, apply_min_p and apply_top_k, in that order, over each row's
// logprobs. mlx-lm's top-p sorts the whole vocabulary (MLX's CPU sort: ~5 ms a row of 49,152
// tokens; 32 rows with top_p took ~170 ms, more than the rest of their step); here a radix sort
// orders only the tokens whose probability can move a float32 sum, and their masses are added
// in mlx-lm's order, each mass MLX's exp: the tokens kept are mlx-lm's.
//
// The draw: argmax(row + gumbel noise), each row with
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
#include <cmath>
#include <cstring>
#include <cstdint>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

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

// a * b + c in 16 lanes, each rounded once (as std::fma).
inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  v16f r;
  for (int h = 0; h < 16; h += 8) {
    _mm256_storeu_ps(reinterpret_cast<float*>(&r) + h, _mm256_fmadd_ps(_mm256_loadu_ps(reinterpret_cast<float*>(&a) + h),
                                                                    _mm256_loadu_ps(reinterpret_cast<float*>(&b) + h),
                                                                    _mm256_loadu_ps(reinterpret_cast<float*>(&c) + h)));
  }
  return r;
#elif defined(__aarch64__)
  v16f r;
  for (int q = 0; q < 16; q += 4) {
    vst1q_f32(reinterpret_cast<float*>(&r) + q, vfmaq_f32(vld1q_f32(reinterpret_cast<float*>(&c) + q), vld1q_f32(reinterpret_cast<float*>(&a) + q),
                                                          vld1q_f32(reinterpret_cast<float*>(&b) + q)));
  }
  return r;
#else
  v16f r;
  for (int l = 0; l < 16; l++) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
#endif
}

// MLX's CPU exp where its float SIMD width is 1, bit for bit: x log2(e) split into n = floor(. + 0.5)
// (MLX adds the 0.5 in double, so exactly) and f, 2^n times a degree-6 polynomial in f evaluated by
// fused multiply-adds; NaN stays, above 88 +inf, below -88 0.
inline v16f mlx_exp16(v16f in) {
  const v16f x = in * 1.442695f;
  const v16f t = __builtin_convertvector(__builtin_convertvector(x, v16i), v16f);  // (toward zero; lanes out of range are replaced below)
  const v16f down = t > x ? t - 1.0f : t;
  const v16f n = x - down >= 0.5f ? down + 1.0f : down;
  const v16f f = x - n;
  const float c[6] = {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                      6.931472028550421e-1f, 1.000000000000000f};
  v16f p = v16f{} + 1.535336188319500e-4f;
  for (float k : c) p = fma16(p, f, v16f{} + k);
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f r = reinterpret_cast<v16f&>(bits) * p;
  r = in != in ? in : r;
  r = in > 88.0f ? v16f{} + __builtin_inff() : r;
  return in < -88.0f ? v16f{} : r;
}

// MLX's exp of n floats (as mlx_exp16), out[i] = exp(in[i] - shift).
void mlx_exp(const float* in, float* out, int n, float shift) {
  int i = 0;
  for (; i + 16 <= n; i += 16) *reinterpret_cast<v16f_u*>(out + i) = mlx_exp16(*reinterpret_cast<const v16f_u*>(in + i) - shift);
  const int rest = n - i;  // (0 to 15)
  if (rest > 0) {
    float x[16] = {}, e[16];
    for (int l = 0; l < rest; l++) x[l] = in[i + l] - shift;
    *reinterpret_cast<v16f_u*>(e) = mlx_exp16(*reinterpret_cast<const v16f_u*>(x));
    for (int l = 0; l < rest && l < 16; l++) out[i + l] = e[l];
  }
}

// A row's maximum, NaN if it holds one (as MLX's CPU maximum takes them).
float row_max(const float* in, int V) {
  v16f top = v16f{} - __builtin_inff();
  v16i nan = v16i{};
  int i = 0;
  for (; i + 16 <= V; i += 16) {
    v16f x = *reinterpret_cast<const v16f_u*>(in + i);
    nan |= x != x;
    top = x > top ? x : top;
  }
  float m = -__builtin_inff();
  bool any_nan = false;
  for (int l = 0; l < 16; l++) m = top[l] > m ? top[l] : m, any_nan |= nan[l] != 0;
  for (; i < V; i++) m = in[i] > m ? in[i] : m, any_nan |= in[i] != in[i];
  return any_nan ? __builtin_nanf("") : m;
}

struct SoftmaxJob {
  const float* in;
  float* out;
  int V;
};

// Rows' x - logsumexp(x) as MLX's CPU computes it: the maximum, the exps of x - max added one after
// another from the first, log(sum) + max (the max itself where infinite). Eight rows at a time, so
// their eight sums' adds, each row's in order, overlap.
void log_softmax_rows(void* ctx, int i0, int i1) {
  const SoftmaxJob& job = *static_cast<const SoftmaxJob*>(ctx);
  const int V = job.V;
  constexpr int G = 8;
  for (int g = i0; g < i1; g += G) {
    const int n = std::min(G, i1 - g);
    const float* in = job.in + static_cast<int64_t>(g) * V;
    float* out = job.out + static_cast<int64_t>(g) * V;
    float top[G], sum[G] = {};
    for (int r = 0; r < n; r++) {
      top[r] = row_max(in + static_cast<int64_t>(r) * V, V);
      mlx_exp(in + static_cast<int64_t>(r) * V, out + static_cast<int64_t>(r) * V, V, top[r]);
    }
    if (n == G) {
      for (int i = 0; i < V; i++) {
        for (int r = 0; r < G; r++) sum[r] += out[static_cast<int64_t>(r) * V + i];
      }
    } else {
      for (int i = 0; i < V; i++) {
        for (int r = 0; r < n; r++) sum[r] += out[static_cast<int64_t>(r) * V + i];
      }
    }
    for (int r = 0; r < n; r++) {
      const float lse = std::isinf(top[r]) ? top[r] : std::log(sum[r]) + top[r];
      const float* x = in + static_cast<int64_t>(r) * V;
      float* y = out + static_cast<int64_t>(r) * V;
      for (int i = 0; i < V; i++) y[i] = x[i] - lse;
    }
  }
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


// Float32 values as uint32 keys whose ascending order is the values' descending order.
inline uint32_t descending_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x80000000u) ? u : ~u & 0x7fffffffu;  // negatives as they are, positives flipped below them
}

inline float from_descending_key(uint32_t k) {
  uint32_t u = (k & 0x80000000u) ? k : ~k & 0x7fffffffu;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Ascending LSD radix sort of 32-bit keys, 11 bits a pass (a pass whose digit all keys share skipped).
void radix_sort(std::vector<uint32_t>& keys, std::vector<uint32_t>& spare) {
  spare.resize(keys.size());
  constexpr int bits = 11, buckets = 1 << bits;
  std::vector<size_t> count(buckets + 1);
  for (int shift = 0; shift < 32; shift += bits) {
    std::fill(count.begin(), count.end(), 0);
    for (uint32_t k : keys) count[((k >> shift) & (buckets - 1)) + 1]++;
    if (std::find(count.begin() + 1, count.end(), keys.size()) != count.end()) continue;  // (one digit: in order already)
    for (int d = 0; d < buckets; d++) count[d + 1] += count[d];
    for (uint32_t k : keys) spare[count[(k >> shift) & (buckets - 1)]++] = k;
    keys.swap(spare);
  }
}

// A token's rank as a 64-bit key, smaller for a likelier token: its value's descending_key, then its
// index (of equal values the lower index first; -0 ties +0), NaN after every number.
inline uint64_t token_key(float v, int i) {
  const uint32_t rank = v != v ? 0xffffffffu : descending_key(v == 0.0f ? 0.0f : v);
  return (static_cast<uint64_t>(rank) << 32) | static_cast<uint32_t>(i);
}

// A row's k likeliest tokens' keys (token_key), the likeliest first, in `heap`: the k smallest keys
// kept in a max-heap as the row is scanned. Once the heap is full, 16 tokens at a time are let past
// unless one beats its worst value (a later token equal to it has a higher index: no better).
void best_keys(const float* row, int V, int k, std::vector<uint64_t>& heap) {
  heap.clear();
  auto offer = [&](int i) {
    const uint64_t key = token_key(row[i], i);
    if (static_cast<int>(heap.size()) < k) {
      heap.push_back(key);
      std::push_heap(heap.begin(), heap.end());
    } else if (key < heap.front()) {
      std::pop_heap(heap.begin(), heap.end());
      heap.back() = key;
      std::push_heap(heap.begin(), heap.end());
    }
  };
  int i = 0;
  for (; i < V && static_cast<int>(heap.size()) < k; i++) offer(i);
  for (; i + 16 <= V; i += 16) {
    if ((heap.front() >> 32) != 0xffffffffu) {  // (the worst kept is a number, not NaN)
      const float worst = from_descending_key(static_cast<uint32_t>(heap.front() >> 32));
      const v16i better = *reinterpret_cast<const v16f_u*>(row + i) > worst;
      int any = 0;
      for (int l = 0; l < 16; l++) any |= better[l];
      if (!any) continue;
    }
    for (int l = 0; l < 16; l++) offer(i + l);
  }
  for (; i < V; i++) offer(i);
  std::sort_heap(heap.begin(), heap.end());
}

// One row of mlx-lm's filters, in place. top_p in (0, 1) on; log_min_p: log(min_p) (float32) or
// -inf (off); top_k in (0, V) on.
void filter_row(float* row, int V, float top_p, float log_min_p, int top_k, std::vector<float>& scratch,
                std::vector<uint32_t>& keys, std::vector<uint32_t>& spare, std::vector<uint64_t>& heap) {
  const float neg_inf = -__builtin_inff();
  if (top_p > 0.0f && top_p < 1.0f) {
    // mlx-lm: ascending sort, mass_above = reverse exclusive cumsum of exp (added from the largest
    // down, in float32), total = mass_above[0] + the smallest; a token is dropped where the mass
    // above it reaches top_p * total. A probability below half a unit in the last place of a
    // float32 sum never changes it, so only the tokens that can are sorted and added, in mlx-lm's
    // order: those within 18 of the largest logprob (exp(-18) < 2^-25, and the sum starts with
    // the largest), and of normalised logprobs, only those above -17.5 (exp(-17.5) < 2^-25,
    // half the unit of a sum from 1/2 up: checked, else the first cut).
    v16f tops = v16f{} + neg_inf;
    int at = 0;
    for (; at + 16 <= V; at += 16) {
      v16f x = *reinterpret_cast<const v16f_u*>(row + at);
      tops = x > tops ? x : tops;  // (NaN never taken)
    }
    float top = neg_inf;
    for (int l = 0; l < 16; l++) top = tops[l] > top ? tops[l] : top;
    for (; at < V; at++) top = row[at] > top ? row[at] : top;
    if (!(top > neg_inf)) return;  // (no finite logprob: nothing to keep apart)
    float total = 0.0f;
    for (float cut : {std::max(top - 18.0f, -17.5f), top - 18.0f}) {
      keys.resize(V);
      size_t n = 0;
      for (int i = 0; i < V; i++) {  // (branch-free: most tokens of a row are on either side at random)
        keys[n] = descending_key(row[i]);
        n += row[i] >= cut;
      }
      keys.resize(n);
      radix_sort(keys, spare);
      scratch.resize(keys.size());
      for (size_t j = 0; j < keys.size(); j++) scratch[j] = from_descending_key(keys[j]);
      mlx_exp(scratch.data(), scratch.data(), static_cast<int>(scratch.size()), 0.0f);  // (mlx-lm's masses: mx.exp)
      total = 0.0f;
      for (float mass : scratch) total += mass;
      if (total >= 0.5f || cut == top - 18.0f) break;
    }
    const float limit = top_p * total;
    float mass = 0.0f, threshold = top;
    for (size_t j = 0; j < keys.size() && mass < limit; j++) {
      threshold = from_descending_key(keys[j]);
      mass += scratch[j];
    }
    for (int i = 0; i < V; i++) {
      if (row[i] < threshold) row[i] = neg_inf;
    }
  }
  if (log_min_p > neg_inf) {
    float top = *std::max_element(row, row + V);
    float floor = top + log_min_p;
    for (int i = 0; i < V; i++) {
      if (row[i] < floor) row[i] = neg_inf;
    }
  }
  if (top_k > 0 && top_k < V) {  // the k largest; of tokens tied with the k-th, the first ones
    best_keys(row, V, top_k, heap);
    const uint64_t last = heap.back();
    for (int i = 0; i < V; i++) {
      if (token_key(row[i], i) > last) row[i] = neg_inf;
    }
  }
}

struct FilterJob {
  const float* in;
  const float* params;  // (n, 3): top_p, log(min_p), top_k
  float* out;
  int V;
};

void filter_rows(void* ctx, int i0, int i1) {
  const FilterJob& job = *static_cast<const FilterJob*>(ctx);
  std::vector<float> scratch;
  std::vector<uint32_t> keys, spare;
  std::vector<uint64_t> heap;
  for (int i = i0; i < i1; i++) {
    float* row = job.out + static_cast<int64_t>(i) * job.V;
    std::copy(job.in + static_cast<int64_t>(i) * job.V, job.in + static_cast<int64_t>(i + 1) * job.V, row);
    const float* p = job.params + 3 * i;
    filter_row(row, job.V, p[0], p[1], static_cast<int>(p[2]), scratch, keys, spare, heap);
  }
}

struct TopJob {
  const float* in;
  uint32_t* out;
  int V, k;
};

// Rows' k likeliest tokens (best_keys' indices).
void top_rows(void* ctx, int i0, int i1) {
  const TopJob& job = *static_cast<const TopJob*>(ctx);
  std::vector<uint64_t> heap;
  for (int i = i0; i < i1; i++) {
    best_keys(job.in + static_cast<int64_t>(i) * job.V, job.V, job.k, heap);
    uint32_t* out = job.out + static_cast<int64_t>(i) * job.k;
    for (int j = 0; j < job.k; j++) out[j] = static_cast<uint32_t>(heap[j]);
  }
}

// Which of the sampled rows' ops a RowOpCPU runs.
enum class RowOp { filter, log_softmax, top_tokens, draw };

// What a RowOpCPU is equivalent by: its op, the threads it shares rows over, top_tokens' k.
struct RowOpParams {
  RowOp op;
  int threads;
  int k = 0;
  bool operator==(const RowOpParams& o) const { return op == o.op && threads == o.threads && k == o.k; }
};

// The sampled rows' ops as one CPU primitive: in[0] the rows (n, V) float32, in[1] the filters'
// settings or the draws' keys; the rows shared over the threads (on the calling thread alone where
// one would do).
class RowOpCPU : public CpuPrimitive<RowOpCPU> {
 public:
  RowOpCPU(mx::Stream stream, RowOpParams p) : CpuPrimitive(stream), params(p) {}

  const char* name() const override {
    static const char* const names[] = {"FilterRowsCPU", "LogSoftmaxCPU", "TopTokensCPU", "GumbelDrawCPU"};
    return names[static_cast<int>(params.op)];
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int n = inputs[0].shape(0);
    switch (params.op) {
      case RowOp::top_tokens: return {{n, params.k}};
      case RowOp::draw: return {{n}};
      default: return {inputs[0].shape()};
    }
  }

  RowOpParams params;

  static void run(const std::vector<mx::array>& in, mx::array& out, const RowOpParams& p) {
    std::vector<char> row_copy, extra_copy;
    const float* rows = reinterpret_cast<const float*>(row_major(in[0], row_copy));
    const int n = in[0].shape(0), V = in[0].shape(1);
    switch (p.op) {
      case RowOp::filter: {
        FilterJob job{rows, reinterpret_cast<const float*>(row_major(in[1], extra_copy)), out.data<float>(), V};
        qm_parallel_for(n, p.threads, filter_rows, &job);
        break;
      }
      case RowOp::log_softmax: {
        SoftmaxJob job{rows, out.data<float>(), V};
        qm_parallel_for(n, p.threads, log_softmax_rows, &job);
        break;
      }
      case RowOp::top_tokens: {
        TopJob job{rows, out.data<uint32_t>(), V, p.k};
        qm_parallel_for(n, p.threads, top_rows, &job);
        break;
      }
      case RowOp::draw: {
        Rows job{rows, reinterpret_cast<const uint32_t*>(row_major(in[1], extra_copy)), out.data<uint32_t>(), V};
        qm_parallel_for(n, p.threads, draw_rows, &job);
        break;
      }
    }
  }
};

mx::array row_op(mx::Shape shape, mx::Dtype dtype, RowOpParams p, std::vector<mx::array> inputs) {
  p.threads = std::max(p.threads, 1);
  return mx::array(std::move(shape), dtype, std::make_shared<RowOpCPU>(cpu_stream(), p), std::move(inputs));
}

}  // namespace

// mlx-lm's apply_top_p, apply_min_p and apply_top_k, in that order, over each row of logprobs (n,
// V) float32, with params (n, 3) float32: top_p (off outside (0, 1)), log(min_p) (-inf: off),
// top_k (off outside (0, V)). Returns (n, V) float32, the filtered tokens -inf.
mx::array filter_rows_op(const mx::array& logprobs, const mx::array& params, int threads) {
  if (logprobs.dtype() != mx::float32 || logprobs.ndim() != 2 || logprobs.shape(1) < 1 || params.dtype() != mx::float32 ||
      params.shape() != mx::Shape{logprobs.shape(0), 3}) {
    throw std::invalid_argument("filter_rows: logprobs must be float32 (n, V) and params float32 (n, 3)");
  }
  return row_op(logprobs.shape(), mx::float32, {RowOp::filter, threads}, {logprobs, params});
}

// Each row's x - logsumexp(x) for rows (n, V) float32, as MLX's CPU computes it where its float SIMD width
// is 1. Returns (n, V) float32.
mx::array log_softmax_op(const mx::array& rows, int threads) {
  if (rows.dtype() != mx::float32 || rows.ndim() != 2 || rows.shape(1) < 1) {
    throw std::invalid_argument("log_softmax: rows must be float32 (n, V)");
  }
  return row_op(rows.shape(), mx::float32, {RowOp::log_softmax, threads}, {rows});
}

// Each row's k most likely tokens for rows (n, V) float32, 1 <= k <= V: (n, k) uint32, the most likely
// first, of equal values the lower index first.
mx::array top_tokens_op(const mx::array& rows, int k, int threads) {
  if (rows.dtype() != mx::float32 || rows.ndim() != 2 || rows.shape(1) < 1) {
    throw std::invalid_argument("top_tokens: rows must be float32 (n, V)");
  }
  if (k < 1 || k > rows.shape(1)) {
    throw std::invalid_argument("top_tokens: k must be from 1 to the rows' width");
  }
  return row_op({rows.shape(0), k}, mx::uint32, {RowOp::top_tokens, threads, k}, {rows});
}

// Each row's argmax(rows[i] + mx.random.gumbel((V,), key=keys[i])): rows (n, V) float32, keys
// (n, 2) uint32. Returns (n,) uint32.
mx::array gumbel_draw_op(const mx::array& rows, const mx::array& keys, int threads) {
  if (rows.dtype() != mx::float32 || rows.ndim() != 2 || rows.shape(1) < 1 || keys.dtype() != mx::uint32 ||
      keys.shape() != mx::Shape{rows.shape(0), 2}) {
    throw std::invalid_argument("gumbel_draw: rows must be float32 (n, V) and keys uint32 (n, 2)");
  }
  return row_op({rows.shape(0)}, mx::uint32, {RowOp::draw, threads}, {rows, keys});
}

}  // namespace mlx_parallm
