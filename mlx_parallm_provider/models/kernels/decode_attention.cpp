// One-token (decode) attention as an MLX primitive (CPU).
//
// On the CPU a decode step's attention, written with MLX's ops, is a dozen ops per layer over
// (B, heads, 1, S) scores (matmuls of one query row, max, exp, sum, a mask): at batch 64 that
// was 40-120 ms of a ~230 ms step. Here each (row, KV head) reads its keys and values once for
// all the query heads of its group, with an online softmax (FlashAttention's running maximum
// and sum) over its keys under its mask.
//
// Inputs: q (B, H, 1, D); k, v (B, KVH, S, D); then, by the flags, a mask (Bm, S) with Bm 1
// or B (bool: true = attend, or additive float32). Strides are read from the arrays (keys and
// values are usually views of a larger cache buffer); one whose last axis is not contiguous
// is copied first. float32 throughout.
//
// Paged variant (paged_decode_attention_op): keys and values live in per-layer pools of
// slots (N, KVH, D), block_size slots a block; row b's tokens are the first lengths[b] slots
// of the blocks table[b][0], table[b][1], ... read through per-position offsets, so the
// softmax tiles span blocks. No mask: one query sees every token its row holds; with several
// query positions a row (a verify step's drafts), position j sees the first limits[b][j]
// tokens, and each position's sums are those it would have alone (a row's KV is read once for
// all its positions, up to kMaxGroup query rows a KV head at a time). The pools are
// float32 or float16 (EngineConfig.kv_cache_dtype): halves are widened to float32 as they are
// read, 16 at a time (F16C / AVX-512 where the build has them), and every sum stays float32.
// Or quantized (kv_cache_dtype int8 / int4, engine/kv/storage.py): the pools hold mx.quantize's
// packed codes (uint32, (N, KVH, D * bits / 32)) beside float16 scales and biases (N, KVH,
// D / 32), one each per 32 values; each tile's K and V of a head are dequantized into a
// thread's float32 scratch (code * scale + bias) and attended as float32 pools are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention_step.h"
#include "cpu_primitive.h"
#include "fast_exp.h"
#include "lane_sums.h"
#include "rope.h"
#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

extern "C" void qm_parallel_for(int items, int threads, void (*fn)(void*, int, int), void* ctx);  // qmatmul.c

namespace mlx_parallm {

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kBlock = 64;     // keys scored before their softmax weights are applied
// (key position, KV head) pairs worth a second thread: a pair costs ~40-50 ns. Counting (row, KV
// head) pairs instead (16 a thread) kept 8 rows at 1,280 tokens on one thread, ~1.5 ms a layer.
constexpr int64_t kWorkPerThread = 1024;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v16f load(const float* p) { return *reinterpret_cast<const v16f_u*>(p); }
inline void store(float* p, v16f v) { *reinterpret_cast<v16f_u*>(p) = v; }

// IEEE half (its bits) -> float, subnormals, infinities and NaNs included.
inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0 && mant == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: mant * 2^-24, normalized
    int shift = 0;
    while (!(mant & 0x400u)) mant <<= 1, shift++;
    bits = sign | static_cast<uint32_t>(127 - 14 - shift) << 23 | (mant & 0x3ffu) << 13;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 112) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 float16 values (their bits) widened to float32.
inline v16f load(const uint16_t* p) {
#if defined(__AVX512F__)
  __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<v16f&>(v);
#elif defined(__F16C__)
  __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  v16f out;
  std::memcpy(&out, halves, sizeof out);
  return out;
#else
  v16f out;
  for (int i = 0; i < 16; i++) out[i] = half_to_float(p[i]);
  return out;
#endif
}

inline v16f vmax(v16f a, v16f b) { return a > b ? a : b; }

inline float hmax(v16f v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512&>(v));
#endif
  float m = v[0];
  for (int i = 1; i < 16; i++) m = std::max(m, v[i]);
  return m;
}

inline float hsum(v16f v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
#endif
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

// Quantized pools: mx.quantize's layout (storage.py), KV_QUANT_GROUP_SIZE values a scale and bias.
constexpr int kQuantGroup = 32;

struct QuantPools {
  const uint32_t* k;  // codes (slots, KVH, D * bits / 32): value i of a word at bits (i % (32 / bits)) * bits
  const uint32_t* v;
  const uint16_t* k_scale;  // float16 bits (slots, KVH, D / kQuantGroup)
  const uint16_t* k_bias;
  const uint16_t* v_scale;
  const uint16_t* v_bias;
  int bits;  // 8 or 4
};

inline float half_scalar(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// out[0 .. groups * kQuantGroup) = code * scale + bias of `groups` groups of one head of a slot.
inline void dequantize(const uint32_t* codes, const uint16_t* scales, const uint16_t* biases, int groups, int bits, float* out) {
  for (int g = 0; g < groups; g++, out += kQuantGroup) {
    float s = half_scalar(scales[g]), b = half_scalar(biases[g]);
#if defined(__AVX512F__)
    // (x86 is little-endian: the words' codes are the bytes', or the nibbles', in order)
    const __m512 sv = _mm512_set1_ps(s), bv = _mm512_set1_ps(b);
    __m128i half[2];
    if (bits == 8) {
      const auto* bytes = reinterpret_cast<const __m128i*>(codes + g * kQuantGroup / 4);
      half[0] = _mm_loadu_si128(bytes), half[1] = _mm_loadu_si128(bytes + 1);
    } else {  // byte k holds values 2k (low nibble) and 2k + 1
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * kQuantGroup / 8));
      const __m128i low = _mm_set1_epi8(0x0f);
      __m128i lo = _mm_and_si128(c, low), hi = _mm_and_si128(_mm_srli_epi16(c, 4), low);
      half[0] = _mm_unpacklo_epi8(lo, hi), half[1] = _mm_unpackhi_epi8(lo, hi);
    }
    for (int i = 0; i < 2; i++)
      _mm512_storeu_ps(out + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(half[i])), sv, bv));
#else
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    const uint32_t* words = codes + g * kQuantGroup / per;
    for (int i = 0; i < kQuantGroup; i++) out[i] = static_cast<float>((words[i / per] >> (i % per * bits)) & mask) * s + b;
#endif
  }
}

// Keys and values of one (row, KV head) segment: `len` positions `stride` elements apart;
// T: float, or uint16_t for float16 bits.
template <class T>
struct SegmentOf {
  const T* k;
  const T* v;
  int64_t k_stride, v_stride;
  int len;
  const uint8_t* keep;  // per position, or null (all kept)
  const float* add;     // additive mask per position, or null
  const int64_t* at = nullptr;  // per position, its offset from k and v (paged KV), or null (pos * stride)
  const int* limit = nullptr;   // per query row, how many positions it sees (its later ones score -inf), or null
  const int* first = nullptr;   // per query row, its first position seen (a sliding window: earlier ones score -inf), or null

  const T* key(int pos) const { return k + (at ? at[pos] : pos * k_stride); }
  const T* value(int pos) const { return v + (at ? at[pos] : pos * v_stride); }
};
using Segment = SegmentOf<float>;

// Running softmax state of the `group` query heads of one (row, KV head).
struct Accumulator {
  int group, dim;
  float q[kMaxGroup][kMaxHeadDim];
  float acc[kMaxGroup][kMaxHeadDim];
  float max[kMaxGroup], sum[kMaxGroup];
  alignas(64) float score[kMaxGroup][kBlock];

  void start(const float* const* queries, float scale) {
    for (int r = 0; r < group; r++) {
      for (int d = 0; d < dim; d++) q[r][d] = queries[r][d] * scale, acc[r][d] = 0.0f;
      max[r] = kNegInf;
      sum[r] = 0.0f;
    }
  }

  template <class T>
  void attend(const SegmentOf<T>& s) {
    // The query rows as a constant keep their sums in registers: a KV head's query heads
    // (decode), or those times a verify step's positions (up to kMaxGroup rows; 15 with 3
    // heads a KV head ran ~2x slower through the general case).
    switch (group) {
#define ATTEND_CASE(n) case n: return attend_as<n>(s);
      ATTEND_CASE(1) ATTEND_CASE(2) ATTEND_CASE(3) ATTEND_CASE(4) ATTEND_CASE(5) ATTEND_CASE(6) ATTEND_CASE(7)
      ATTEND_CASE(8) ATTEND_CASE(9) ATTEND_CASE(10) ATTEND_CASE(12) ATTEND_CASE(14) ATTEND_CASE(15) ATTEND_CASE(16)
#undef ATTEND_CASE
      default: return attend_as<0>(s);
    }
  }

  // G query heads (0: `group`, not known at compile time).
  template <int G, class T>
  void attend_as(const SegmentOf<T>& s) {
    const int heads = G ? G : group;
    for (int start = 0; start < s.len; start += kBlock) {
      int n = std::min(kBlock, s.len - start);
#if defined(__AVX512F__)
      bool any = true;
      if (!s.keep && !s.add)  // (paged KV: no mask) every row's scores 16 positions at a time
        score_tiles<G>(s, start, n, heads);
      else
        any = score_positions<G>(s, start, n, heads);
#elif defined(__AVX2__) && defined(__FMA__)
      bool any = score_tiles8(s, start, n, heads);  // (every tile, masked or not)
#else
      bool any = score_positions<G>(s, start, n, heads);
#endif
      if (!any) continue;
      for (int r = 0; r < heads; r++) {
        // The tile's largest score, 16 at a time (past n the scores are -inf): a max is exact
        // in any order, and the scalar chain it replaces was a fifth of the kernel's time.
        v16f most = load(score[r]);
        for (int j = 16; j < kBlock; j += 16) most = vmax(most, load(score[r] + j));
        float top = std::max(max[r], hmax(most));
        if (top == kNegInf) {  // every score masked so far (a window starting later): the tile adds nothing
          for (int j = 0; j < kBlock; j += 16) store(score[r] + j, v16f{});
          continue;
        }
        float rescale = std::exp(max[r] - top);
        max[r] = top;
        v16f total = v16f{};
        for (int j = 0; j < kBlock; j += 16) {
          v16f p = exp16(load(score[r] + j) - top);
          store(score[r] + j, p);
          total += p;
        }
        sum[r] = sum[r] * rescale + hsum(total);
        if (rescale != 1.0f) {
          for (int d = 0; d < dim; d += 16) store(acc[r] + d, load(acc[r] + d) * rescale);
        }
      }
      // Over the block's values, kSpan * 16 dimensions at a time: with few query heads, one
      // span of 16 left each head's sum a chain of dependent additions (latency-bound); each
      // dimension's additions stay in the same order, so the sums are the same.
#if defined(__AVX512F__)
      constexpr int kSpan = G == 0 ? 1 : G <= 4 ? 4 : G <= 8 ? 2 : 1;
#else  // (16 vector registers of half the width: 2 x 3 heads' spans of 16 take 12 of them)
      constexpr int kSpan = G == 0 ? 1 : G <= 3 ? 2 : 1;
#endif
      int d0 = 0;
      for (; d0 + 16 * kSpan <= dim; d0 += 16 * kSpan) add_values<G, kSpan>(s, start, n, heads, d0);
      for (; d0 < dim; d0 += 16) add_values<G, 1>(s, start, n, heads, d0);
    }
  }

  // score[r][0 .. kBlock) of the tile's n positions from `start`, one position at a time
  // (G query heads, 0: `heads`), masks and limits applied. Returns whether any is kept.
  template <int G, class T>
  bool score_positions(const SegmentOf<T>& s, int start, int n, int heads) {
    bool any = false;
    for (int j = 0; j < kBlock; j++) {
      int pos = start + j;
      if (j >= n || (s.keep && !s.keep[pos])) {
        for (int r = 0; r < heads; r++) score[r][j] = kNegInf;
        continue;
      }
      any = true;
      const T* key = s.key(pos);
      v16f dot[G ? G : kMaxGroup] = {};
      for (int d = 0; d < dim; d += 16) {
        v16f kd = load(key + d);
        for (int r = 0; r < heads; r++) dot[r] += load(q[r] + d) * kd;
      }
      float bias = s.add ? s.add[pos] : 0.0f;
      for (int r = 0; r < heads; r++)
        score[r][j] = (s.limit && pos >= s.limit[r]) || (s.first && pos < s.first[r]) ? kNegInf : hsum(dot[r]) + bias;
    }
    return any;
  }

#if defined(__AVX512F__)
  // score[r][0 .. kBlock) of the tile's n positions from `start` (none masked): for each query
  // row, 16 positions' products as 16 vectors, then their 16 lane sums together
  // (lane_sums16: the tree of _mm512_reduce_add_ps, so each score is the one-position loop's
  // bit for bit) instead of one reduction a position, which was most of a score's work.
  template <int G, class T>
  void score_tiles(const SegmentOf<T>& s, int start, int n, int heads) {
    static const T zeros[kMaxHeadDim] = {};  // the "key" of a position past n (its score is masked)
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    for (int j0 = 0; j0 < kBlock; j0 += 16) {
      int count = std::min(16, n - j0);
      if (count <= 0) {
        for (int r = 0; r < heads; r++) _mm512_storeu_ps(score[r] + j0, neg_inf);
        continue;
      }
      const T* keys[16];
      for (int jj = 0; jj < 16; jj++) keys[jj] = jj < count ? s.key(start + j0 + jj) : zeros;
      __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
      for (int r = 0; r < heads; r++) {
        __m512 dots[16];
        for (int jj = 0; jj < 16; jj++) dots[jj] = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 16) {
          v16f qd = load(q[r] + d);
          __m512 qv = reinterpret_cast<__m512&>(qd);
          for (int jj = 0; jj < 16; jj++) {
            v16f kd = load(keys[jj] + d);
            dots[jj] = _mm512_fmadd_ps(qv, reinterpret_cast<__m512&>(kd), dots[jj]);
          }
        }
        __mmask16 seen = valid;
        if (s.limit) {  // positions at or past the row's limit score -inf
          int last = s.limit[r] - (start + j0);
          seen &= last <= 0 ? 0 : last >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << last) - 1);
        }
        if (s.first) {  // and those before its window's first
          int before = s.first[r] - (start + j0);
          seen &= before <= 0 ? 0xFFFF : before >= 16 ? 0 : static_cast<__mmask16>(~((1u << before) - 1));
        }
        // (+ 0.0f as the one-position loop adds its absent mask's bias: -0.0 becomes +0.0)
        __m512 sums = _mm512_add_ps(lane_sums16(dots), _mm512_setzero_ps());
        _mm512_storeu_ps(score[r] + j0, _mm512_mask_blend_ps(seen, neg_inf, sums));
      }
    }
  }
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

  // AVX2 builds: score[r][0 .. kBlock) of the tile's n positions from `start`, masks and limits
  // applied, 8 positions at a time: each position's products in an 8-lane chain over the
  // dimensions, and the 8 positions' lane sums together (lane_sums8). The one-position loop
  // summed a 16-lane vector lane by lane, a chain of 16 dependent scalar additions a score:
  // a one-row step's attention at 1,256 tokens was ~2x the AVX-512 build's. Returns whether
  // any position is kept.
  template <class T>
  bool score_tiles8(const SegmentOf<T>& s, int start, int n, int heads) {
    static const T zeros[kMaxHeadDim] = {};  // the "key" of a position past n (its score is masked)
    bool any = false;
    for (int j0 = 0; j0 < kBlock; j0 += 8) {
      int count = std::min(8, n - j0);
      const T* keys[8];
      for (int jj = 0; jj < 8; jj++) keys[jj] = jj < count ? s.key(start + j0 + jj) : zeros;
      for (int jj = 0; jj < count && !any; jj++) any = !s.keep || s.keep[start + j0 + jj];
      for (int r = 0; r < heads; r++) {
        if (count <= 0) {
          for (int jj = 0; jj < 8; jj++) score[r][j0 + jj] = kNegInf;
          continue;
        }
        __m256 dots[8];
        for (int jj = 0; jj < 8; jj++) dots[jj] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d += 8) {
          __m256 qv = _mm256_loadu_ps(q[r] + d);
          for (int jj = 0; jj < 8; jj++) dots[jj] = _mm256_fmadd_ps(qv, load8(keys[jj] + d), dots[jj]);
        }
        _mm256_storeu_ps(score[r] + j0, lane_sums8(dots));
        for (int jj = 0; jj < 8; jj++) {
          int pos = start + j0 + jj;
          bool masked = jj >= count || (s.keep && !s.keep[pos]) || (s.limit && pos >= s.limit[r]) || (s.first && pos < s.first[r]);
          score[r][j0 + jj] = masked ? kNegInf : score[r][j0 + jj] + (s.add ? s.add[pos] : 0.0f);
        }
      }
    }
    return any;
  }
#endif

  // acc[r][d0 .. d0 + 16 * SPAN) += the tile's values weighted by score[r] (G query heads, 0:
  // `heads`), each dimension summed over the positions in order.
  template <int G, int SPAN, class T>
  void add_values(const SegmentOf<T>& s, int start, int n, int heads, int d0) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if constexpr (G > 0) {  // (GCC's 64-byte generic vectors, lowered to pairs of ymm, spilled every sum)
      constexpr int W = 2 * SPAN;  // 8-float vectors a head's span
      __m256 part[G][W];
      for (int r = 0; r < G; r++)
        for (int c = 0; c < W; c++) part[r][c] = _mm256_loadu_ps(acc[r] + d0 + 8 * c);
      for (int j = 0; j < n; j++) {
        if (s.keep && !s.keep[start + j]) continue;
        const T* value = s.value(start + j) + d0;
        for (int c = 0; c < W; c++) {
          __m256 v = load8(value + 8 * c);
          for (int r = 0; r < G; r++) part[r][c] = _mm256_fmadd_ps(v, _mm256_set1_ps(score[r][j]), part[r][c]);
        }
      }
      for (int r = 0; r < G; r++)
        for (int c = 0; c < W; c++) _mm256_storeu_ps(acc[r] + d0 + 8 * c, part[r][c]);
      return;
    }
#endif
    v16f part[G ? G : kMaxGroup][SPAN];
    for (int r = 0; r < heads; r++)
      for (int c = 0; c < SPAN; c++) part[r][c] = load(acc[r] + d0 + 16 * c);
    for (int j = 0; j < n; j++) {
      if (s.keep && !s.keep[start + j]) continue;
      const T* value = s.value(start + j) + d0;
      for (int c = 0; c < SPAN; c++) {
        v16f v = load(value + 16 * c);
        for (int r = 0; r < heads; r++) part[r][c] += v * score[r][j];
      }
    }
    for (int r = 0; r < heads; r++)
      for (int c = 0; c < SPAN; c++) store(acc[r] + d0 + 16 * c, part[r][c]);
  }

  void finish(float* const* outputs) const {
    for (int r = 0; r < group; r++) {
      float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
      for (int d = 0; d < dim; d++) outputs[r][d] = acc[r][d] * inv;
    }
  }
};

enum Flags { kMaskBool = 1, kMaskAdditive = 2 };

// task(0 .. items - 1), shared by this thread and up to `threads - 1` of the packed-weight
// kernel's pool of helpers (qmatmul.c); `work`: the (key position, KV head) pairs of all the
// items, which decides how many threads pay.
void run_items(int items, int threads, const std::function<void(int)>& task, int64_t work) {
  int use = static_cast<int>(std::min<int64_t>({threads, std::max<int64_t>(work / kWorkPerThread, 1), items}));
  if (use <= 1) {
    for (int item = 0; item < items; item++) task(item);
    return;
  }
  auto call = [](void* ctx, int i0, int i1) {
    const auto& run = *static_cast<const std::function<void(int)>*>(ctx);
    for (int item = i0; item < i1; item++) run(item);
  };
  qm_parallel_for(items, use, call, const_cast<void*>(static_cast<const void*>(&task)));
}

struct DecodeParams {
  float scale;
  int flags, threads;
  bool operator==(const DecodeParams& o) const { return scale == o.scale && flags == o.flags && threads == o.threads; }
};

class DecodeAttentionCPU : public CpuPrimitive<DecodeAttentionCPU> {
 public:
  DecodeAttentionCPU(mx::Stream stream, DecodeParams p) : CpuPrimitive(stream), params(p) {}

  const char* name() const override { return "DecodeAttentionCPU"; }

  DecodeParams params;

  // A float32 array's data with a contiguous last axis (a copy where it is not) and strides.
  struct View {
    const float* data;
    std::vector<int64_t> strides;
    std::vector<char> copy;

    explicit View(const mx::array& a) : data(a.data<float>()), strides(a.strides().begin(), a.strides().end()) {
      if (a.ndim() && a.shape(-1) > 1 && a.strides().back() != 1) {
        data = reinterpret_cast<const float*>(row_major(a, copy));
        strides.assign(a.ndim(), 1);
        for (int d = a.ndim() - 2; d >= 0; d--) strides[d] = strides[d + 1] * a.shape(d + 1);
      }
    }
  };

  static void run(const std::vector<mx::array>& in, mx::array& out, const DecodeParams& prm) {
    const float scale = prm.scale;
    const int flags = prm.flags;
    const auto& q = in[0];
    View qv(in[0]), kv(in[1]), vv(in[2]);
    int B = q.shape(0), H = q.shape(1), D = q.shape(3), KVH = in[1].shape(1), S = in[1].shape(2);
    int group = H / KVH;
    const mx::array* mask = (flags & (kMaskBool | kMaskAdditive)) ? &in[3] : nullptr;
    float* od = out.data<float>();
    auto task = [&](int item) {
      int b = item / KVH, g = item % KVH;
      static thread_local Accumulator a;
      a.group = group, a.dim = D;
      const float* queries[kMaxGroup];
      float* outputs[kMaxGroup];
      for (int r = 0; r < group; r++) {
        int h = g * group + r;
        queries[r] = qv.data + b * qv.strides[0] + h * qv.strides[1];
        outputs[r] = od + (static_cast<int64_t>(b) * H + h) * D;
      }
      a.start(queries, scale);
      Segment own{kv.data + b * kv.strides[0] + g * kv.strides[1], vv.data + b * vv.strides[0] + g * vv.strides[1],
                  kv.strides[2], vv.strides[2], S, nullptr, nullptr};
      if (mask) {
        int64_t row = mask->shape(0) == 1 ? 0 : b * mask->strides(0);
        if (flags & kMaskBool) own.keep = mask->data<uint8_t>() + row;
        else own.add = mask->data<float>() + row;
      }
      a.attend(own);
      a.finish(outputs);
    };
    run_items(B * KVH, prm.threads, task, static_cast<int64_t>(B) * KVH * S);
  }
};


// Where a paged call's queries are read and its outputs written: row b, head h, position j
// at b * row + h * head + j * position floats (each D contiguous floats).
struct QueryLayout {
  const float* q;
  float* out;
  int64_t row, head, position;
};

// Attention of B rows' L query positions (H heads of D) over their blocks `table` (B, M) in
// the pools (slots, KVH, D); position j of row b sees the first limits[b * L + j] tokens, or
// with a sliding `window` (> 0) the last `window` of them (a window's earlier blocks may be
// released: their table entries are never read). A pass's tiles start at a multiple of kBlock
// (the first holding a position some query of the pass sees), so each position's sums are
// those it has alone.
// `quant` (T float, kp and vp unused): quantized pools, each tile's K and V of a head dequantized
// into a thread's scratch before they are attended.
template <class T>
void paged_attend(const T* kp, const T* vp, int64_t slots, int KVH, const int32_t* table, int M, const int32_t* limits,
                  const QueryLayout& io, int B, int H, int L, int D, float scale, int bs, int threads, int window = 0,
                  const QuantPools* quant = nullptr) {
  int group = H / KVH;
  int64_t slot_stride = static_cast<int64_t>(KVH) * D;
  const int64_t code_stride = quant ? slot_stride * quant->bits / 32 : 0;  // uint32 words of a slot's codes
  const int64_t scale_stride = slot_stride / kQuantGroup;                // its scales (and biases)
  // Each row's real positions: a right-padded pass's padding repeats its row's last limit
  // (a real position sees one token more than the one before it). Padding is not attended:
  // its outputs are copies of its row's last real position's.
  std::vector<int> real(B);
  for (int b = 0; b < B; b++) real[b] = real_positions(limits + static_cast<int64_t>(b) * L, L);
  int64_t work = 0;  // (key position, KV head) pairs, a position's keys counted once per query position
  for (int b = 0; b < B; b++)
    for (int j = 0; j < real[b]; j++) {
      int64_t seen = std::min<int64_t>(limits[static_cast<int64_t>(b) * L + j], static_cast<int64_t>(M) * bs);
      work += (window > 0 ? std::min<int64_t>(seen, window) : seen) * KVH;
    }
  auto at_of = [&](int b, int h, int j) { return b * io.row + h * io.head + j * io.position; };
  // One item per pass of a row's query positions (at most kMaxGroup query rows a KV head), its
  // KV heads side by side a tile of positions at a time: a slot holds every head's K (then V)
  // in one run of memory, read once for all of them (an item per (row, head) read each slot
  // once per head, a third of it each time here). Each head's sums are those it would have
  // alone (the same tiles of kBlock positions, in order), whatever rows share its pass.
  // Fewer rows than threads (with work enough for two) are spread over the threads: a row's
  // positions in passes for every thread (a verify step or a short prefill piece of one row
  // is compute-bound: 12 positions at 1,256 tokens, 21.5 -> 11.4 ms for 30 layers on 2
  // threads; each pass reads the row's KV), then, still fewer items than threads, its KV
  // heads shared out (one row decoding at 1,256 tokens: 16.5 -> 9.8 ms on 2 threads).
  bool spread = B < threads && work >= 2 * kWorkPerThread;
  int most = std::max(1, kMaxGroup / group);  // query positions an accumulator holds
  int passes = (L + most - 1) / most;
  if (spread) {  // a multiple of the threads each row's passes take
    int share = (threads + B - 1) / B;
    passes = std::min(L, (passes + share - 1) / share * share);
  }
  int per_pass = (L + passes - 1) / passes;
  passes = (L + per_pass - 1) / per_pass;
  int parts = 1;  // KV heads split between a pass's items
  if (spread && B * passes < threads) parts = std::min(KVH, (threads + B * passes - 1) / (B * passes));
  run_items(B * passes * parts, threads, [&](int item) {
    static thread_local std::vector<Accumulator> heads;
    if (static_cast<int>(heads.size()) < KVH) heads.resize(KVH);
    int part = item % parts, b = item / parts / passes;
    int g0 = part * KVH / parts, g1 = (part + 1) * KVH / parts;
    const int32_t* row = table + static_cast<int64_t>(b) * M;
    int j0 = item / parts % passes * per_pass;
    int j1 = std::min(real[b], j0 + per_pass), rows = (j1 - j0) * group;
    if (rows <= 0) return;
    int limit[kMaxGroup], first[kMaxGroup], len = 0, lowest = std::numeric_limits<int>::max();
    for (int j = j0; j < j1; j++)
      for (int r = 0; r < group; r++) {
        int i = (j - j0) * group + r;
        limit[i] = std::min(limits[static_cast<int64_t>(b) * L + j], M * bs);
        first[i] = window > 0 ? std::max(0, limits[static_cast<int64_t>(b) * L + j] - window) : 0;
        len = std::max(len, limit[i]);
        lowest = std::min(lowest, first[i]);
      }
    int begin = lowest / kBlock * kBlock;  // the pass's first tile
    for (int g = g0; g < g1; g++) {
      Accumulator& a = heads[g];
      a.group = rows, a.dim = D;
      const float* queries[kMaxGroup];
      for (int j = j0; j < j1; j++)
        for (int r = 0; r < group; r++) queries[(j - j0) * group + r] = io.q + at_of(b, g * group + r, j);
      a.start(queries, scale);
    }
    // Every position's offset, so that the softmax tiles run across blocks (a row's blocks
    // are seldom consecutive once it decodes); a block outside the pools ends the row.
    static thread_local std::vector<int64_t> at;
    at.resize(len);
    int n = begin;
    for (; n < len; n++) {
      int64_t slot = static_cast<int64_t>(row[n / bs]) * bs + n % bs;
      if (row[n / bs] < 0 || slot >= slots) break;
      at[n] = quant ? slot : slot * slot_stride;  // (quantized: the slot, its arrays' strides differ)
    }
    const int* limit_of = L > 1 ? limit : nullptr;  // (one position: it sees the row's n tokens)
    const int* first_of = window > 0 ? first : nullptr;
    const int64_t slot_bytes = static_cast<int64_t>(g1 - g0) * D * static_cast<int64_t>(sizeof(T));  // this item's heads of a slot
    auto attend = [&](int g, int start, auto seg) {
      int shifted[kMaxGroup], shifted_first[kMaxGroup];  // the limits counted from this tile's first position
      if (limit_of) {
        for (int r = 0; r < rows; r++) shifted[r] = limit_of[r] - start;
        seg.limit = shifted;
      }
      if (first_of) {
        for (int r = 0; r < rows; r++) shifted_first[r] = first_of[r] - start;
        seg.first = shifted_first;
      }
      heads[g].attend(seg);
    };
    static thread_local std::vector<float> scratch;  // quantized pools: a tile's K, then V, of one head
    if (quant) scratch.resize(2 * static_cast<size_t>(kBlock) * D);
    const int groups = D / kQuantGroup;
    for (int start = begin; start < n; start += kBlock) {
      int tile = std::min(kBlock, n - start);
      // Ask for the next tile's slots (every head's K and V) while this one is computed:
      // its blocks lie anywhere in the pools, so the hardware's stream prefetch cannot
      // follow. ~1.3x a row at 1,024 tokens of context on a 2-core Xeon; bit-identical.
      for (int p = start + kBlock; p < std::min(start + 2 * kBlock, n); p++) {
        if (quant) {
          const int64_t words = code_stride / KVH * (g1 - g0);
          const char* key = reinterpret_cast<const char*>(quant->k + at[p] * code_stride + g0 * code_stride / KVH);
          const char* value = reinterpret_cast<const char*>(quant->v + at[p] * code_stride + g0 * code_stride / KVH);
          for (int64_t o = 0; o < words * 4; o += 64) {
            __builtin_prefetch(key + o);
            __builtin_prefetch(value + o);
          }
          const int64_t first_scale = at[p] * scale_stride + g0 * groups;
          for (const uint16_t* a : {quant->k_scale, quant->k_bias, quant->v_scale, quant->v_bias}) __builtin_prefetch(a + first_scale);
          continue;
        }
        const char* key = reinterpret_cast<const char*>(kp + at[p] + g0 * D);
        const char* value = reinterpret_cast<const char*>(vp + at[p] + g0 * D);
        for (int64_t o = 0; o < slot_bytes; o += 64) {
          __builtin_prefetch(key + o);
          __builtin_prefetch(value + o);
        }
      }
      for (int g = g0; g < g1; g++) {
        if (!quant) {
          attend(g, start, SegmentOf<T>{kp + g * D, vp + g * D, slot_stride, slot_stride, tile, nullptr, nullptr, at.data() + start});
          continue;
        }
        // The tile's K and V of head g as float32, once for every query row of the pass.
        float *keys = scratch.data(), *values = keys + static_cast<size_t>(kBlock) * D;
        const int64_t head_words = g * code_stride / KVH, head_scales = g * groups;
        for (int p = 0; p < tile; p++) {
          int64_t slot = at[start + p];
          int64_t c = slot * code_stride + head_words, sc = slot * scale_stride + head_scales;
          dequantize(quant->k + c, quant->k_scale + sc, quant->k_bias + sc, groups, quant->bits, keys + static_cast<int64_t>(p) * D);
          dequantize(quant->v + c, quant->v_scale + sc, quant->v_bias + sc, groups, quant->bits, values + static_cast<int64_t>(p) * D);
        }
        attend(g, start, Segment{keys, values, D, D, tile, nullptr, nullptr});
      }
    }
    for (int g = g0; g < g1; g++) {
      float* outputs[kMaxGroup];
      for (int j = j0; j < j1; j++)
        for (int r = 0; r < group; r++) outputs[(j - j0) * group + r] = io.out + at_of(b, g * group + r, j);
      heads[g].finish(outputs);
    }
  }, work);
  for (int b = 0; b < B; b++)
    for (int j = real[b]; j < L; j++)
      for (int h = 0; h < H; h++) std::memcpy(io.out + at_of(b, h, j), io.out + at_of(b, h, real[b] - 1), D * sizeof(float));
}

struct PagedParams {
  float scale;
  int block_size, threads;
  int window;  // a sliding window's tokens (0: none)
  int bits = 0;  // quantized pools: their codes' bits (0: float32 or float16 pools)
  bool operator==(const PagedParams& o) const {
    return scale == o.scale && block_size == o.block_size && threads == o.threads && window == o.window && bits == o.bits;
  }
};

class PagedDecodeAttentionCPU : public CpuPrimitive<PagedDecodeAttentionCPU> {
 public:
  PagedDecodeAttentionCPU(mx::Stream stream, PagedParams p) : CpuPrimitive(stream), params(p) {}

  const char* name() const override { return "PagedDecodeAttentionCPU"; }

  PagedParams params;

  static void run(const std::vector<mx::array>& in, mx::array& out, const PagedParams& prm) {
    for (size_t i = 1; i < in.size(); i++) {
      if ((i < 3 || i > 4) && !in[i].flags().row_contiguous)
        throw std::runtime_error("paged_decode_attention: the pools (and their scales) must be row-contiguous");
    }
    const auto& q = in[0];
    int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
    QueryLayout io{q.data<float>(), out.data<float>(), static_cast<int64_t>(H) * L * D, static_cast<int64_t>(L) * D, D};
    if (prm.bits) {  // inputs 5-8: the K scales and biases, the V scales and biases
      QuantPools quant{in[1].data<uint32_t>(), in[2].data<uint32_t>(), in[5].data<uint16_t>(), in[6].data<uint16_t>(),
                       in[7].data<uint16_t>(), in[8].data<uint16_t>(), prm.bits};
      paged_attend<float>(nullptr, nullptr, in[1].shape(0), in[1].shape(1), in[3].data<int32_t>(), in[3].shape(1),
                          in[4].data<int32_t>(), io, B, H, L, D, prm.scale, prm.block_size, prm.threads, prm.window, &quant);
      return;
    }
    auto go = [&](auto* kp, auto* vp) {
      paged_attend(kp, vp, in[1].shape(0), in[1].shape(1), in[3].data<int32_t>(), in[3].shape(1), in[4].data<int32_t>(), io,
                   B, H, L, D, prm.scale, prm.block_size, prm.threads, prm.window);
    };
    if (in[1].dtype() == mx::float16) go(in[1].data<uint16_t>(), in[2].data<uint16_t>());
    else go(in[1].data<float>(), in[2].data<float>());
  }
};

// float -> IEEE half bits, rounded to nearest even (as MLX's astype to float16); NaN stays NaN.
inline uint16_t float_to_half(float value) {
  uint32_t f;
  std::memcpy(&f, &value, sizeof f);
  uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint16_t out;
  if (f >= (127u + 16u) << 23) {  // too large for a half, infinity or NaN
    out = f > 255u << 23 ? 0x7e00 : 0x7c00;
  } else if (f < 113u << 23) {  // a half subnormal (or zero): let float addition round it
    const uint32_t magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float x, magic;
    std::memcpy(&x, &f, sizeof x);
    std::memcpy(&magic, &magic_bits, sizeof magic);
    x += magic;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    out = static_cast<uint16_t>(bits - magic_bits);
  } else {
    uint32_t odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
    out = static_cast<uint16_t>(f >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline void store_as(float* dst, const float* src, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_as(uint16_t* dst, const float* src, int n) {
  for (int i = 0; i < n; i++) dst[i] = float_to_half(src[i]);
}

// The `D` values at `x` (one head's K or V of a position) as storage.py writes them into
// quantized pools: rounded to float16, then mx.quantize's affine quantization (its CPU
// kernel's float32 arithmetic, step by step: the same codes, scales and biases, bit for
// bit) in groups of kQuantGroup: `codes` D * bits / 32 words, `scales` and `biases` D /
// kQuantGroup float16 bits.
inline void quantize_head(const float* x, int D, int bits, uint32_t* codes, uint16_t* scales, uint16_t* biases) {
  const float n_bins = static_cast<float>((1 << bits) - 1), eps = 1e-7f;
  const int per = 32 / bits;
  float w[kQuantGroup];
  for (int g = 0; g < D / kQuantGroup; g++) {
    float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
    for (int j = 0; j < kQuantGroup; j++) {
      w[j] = half_scalar(float_to_half(x[g * kQuantGroup + j]));
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    bool mask = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    float edge = mask ? w_min : w_max;
    float q0 = std::rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = edge / q0;
      bias = edge;
    }
    for (int j = 0; j < kQuantGroup / per; j++) {
      uint32_t word = 0;
      for (int k = 0; k < per; k++) {
        float code = std::rint((w[j * per + k] - bias) / scale);
        code = std::min(std::max(code, 0.0f), n_bins);
        word |= static_cast<uint32_t>(code) << (k * bits);
      }
      codes[g * kQuantGroup / per + j] = word;
    }
    scales[g] = float_to_half(scale);
    biases[g] = float_to_half(bias);
  }
}

template <class T>
void step_rows_as(const float* const* q_rows, const float* const* k_rows, const float* const* v_rows, T* kp, T* vp,
                  int64_t slots, int KVH, const int32_t* where, const int32_t* table, int M, const int32_t* limits,
                  const int32_t* offset, const float* freq, int64_t fs, int B, int L, int H, int D, int rope_dims,
                  bool traditional, float rope_scale, float scale, int bs, int threads, float* out,
                  const QuantPools* quant = nullptr) {
  int64_t slot_stride = static_cast<int64_t>(KVH) * D;
  int half = rope_dims / 2;
  std::vector<float> rotated(static_cast<size_t>(B) * L * H * D), key(D), cs(half), sn(half);
  for (int b = 0; b < B; b++) {
    for (int j = 0; j < L; j++) {
      int64_t r = static_cast<int64_t>(b) * L + j;
      rope_angles((static_cast<float>(j) + static_cast<float>(offset[b])) * rope_scale, half, freq, fs, cs.data(), sn.data());
      for (int h = 0; h < H; h++)
        rope_rotate(q_rows[r] + h * D, 1, rotated.data() + (r * H + h) * D, D, rope_dims, traditional, cs.data(), sn.data());
      int64_t slot = where[r];
      if (slot < 0 || slot >= slots) throw std::runtime_error("paged_attention_step: a write slot lies outside the pools");
      for (int g = 0; g < KVH; g++) {
        rope_rotate(k_rows[r] + g * D, 1, key.data(), D, rope_dims, traditional, cs.data(), sn.data());
        if (quant) {  // (its arrays are written in place, as the float pools are)
          const int64_t words = static_cast<int64_t>(D) * quant->bits / 32, c = (slot * KVH + g) * words;
          const int64_t sc = (slot * KVH + g) * (D / kQuantGroup);
          quantize_head(key.data(), D, quant->bits, const_cast<uint32_t*>(quant->k) + c, const_cast<uint16_t*>(quant->k_scale) + sc,
                        const_cast<uint16_t*>(quant->k_bias) + sc);
          quantize_head(v_rows[r] + g * D, D, quant->bits, const_cast<uint32_t*>(quant->v) + c,
                        const_cast<uint16_t*>(quant->v_scale) + sc, const_cast<uint16_t*>(quant->v_bias) + sc);
          continue;
        }
        store_as(kp + slot * slot_stride + g * D, key.data(), D);
        store_as(vp + slot * slot_stride + g * D, v_rows[r] + g * D, D);
      }
    }
  }
  int64_t hd = static_cast<int64_t>(H) * D;
  QueryLayout io{rotated.data(), out, L * hd, D, hd};
  paged_attend<T>(kp, vp, slots, KVH, table, M, limits, io, B, H, L, D, scale, bs, threads, 0, quant);
}

// A decode (or verify) step's attention with what precedes it, as one op: RoPE on the
// queries and new keys, the new keys and values written into the pools at their slots (in
// place: the caller orders later readers after this op), then PagedDecodeAttentionCPU's
// attention, read and written in the projections' layout (B, L, heads * D), so no transposes
// or copies surround it. Each part computes what the separate ops compute, bit for bit.
class PagedAttentionStepCPU : public CpuPrimitive<PagedAttentionStepCPU> {
 public:
  PagedAttentionStepCPU(mx::Stream stream, StepParams p) : CpuPrimitive(stream), params(p) {}

  const char* name() const override { return "PagedAttentionStepCPU"; }

  StepParams params;

  // Row r (of `width` floats, the last axis contiguous) of a 3-D array.
  struct Rows {
    const float* data;
    std::vector<char> copy;
    const mx::array* a;
    int width;
    explicit Rows(const mx::array& x) : data(x.data<float>()), a(&x), width(x.shape(2)) {
      if (x.shape(2) > 1 && x.strides().back() != 1) {
        data = reinterpret_cast<const float*>(row_major(x, copy));
        a = nullptr;
      }
    }
    const float* row(int64_t r) const {
      return a ? data + mx::elem_to_loc(r * width, a->shape(), a->strides()) : data + r * width;
    }
  };

  static void run(const std::vector<mx::array>& in, mx::array& out, const StepParams& prm) {
    Rows q(in[0]), k(in[1]), v(in[2]);
    int B = in[0].shape(0), L = in[0].shape(1);
    std::vector<const float*> rows(3 * static_cast<size_t>(B) * L);
    for (int64_t r = 0; r < static_cast<int64_t>(B) * L; r++) {
      rows[r] = q.row(r);
      rows[B * L + r] = k.row(r);
      rows[2 * B * L + r] = v.row(r);
    }
    attention_step_rows(rows.data(), rows.data() + B * L, rows.data() + 2 * B * L, &in[3], B, L, prm, out.data<float>());
  }
};

}  // namespace

// See attention_step.h.
void attention_step_rows(const float* const* q_rows, const float* const* k_rows, const float* const* v_rows,
                         const mx::array* step, int B, int L, const StepParams& p, float* out) {
  const auto &k_pool = step[0], &v_pool = step[1];
  if (!k_pool.flags().row_contiguous || !v_pool.flags().row_contiguous || k_pool.data_size() != k_pool.size() ||
      v_pool.data_size() != v_pool.size()) {
    throw std::runtime_error("paged_attention_step: the pools must be whole row-contiguous arrays");
  }
  // Quantized pools (uint32 codes): step[7 .. 10] their K scales and biases, V scales and biases.
  const bool quantized = k_pool.dtype() == mx::uint32;
  const int D = quantized ? step[7].shape(2) * kQuantGroup : k_pool.shape(2);
  auto go = [&](auto* kp, auto* vp, const QuantPools* quant = nullptr) {
    step_rows_as(q_rows, k_rows, v_rows, kp, vp, k_pool.shape(0), k_pool.shape(1), step[2].data<int32_t>(),
                 step[3].data<int32_t>(), step[3].shape(1), step[4].data<int32_t>(), step[5].data<int32_t>(),
                 step[6].data<float>(), step[6].strides().back(), B, L, p.heads, D, p.rope_dims, p.traditional,
                 p.rope_scale, p.scale, p.block_size, p.threads, out, quant);
  };
  // (The pools are written in place: the op's callers order the pools' later readers after it.)
  if (quantized) {
    for (int i = 7; i < 11; i++) {
      if (!step[i].flags().row_contiguous || step[i].data_size() != step[i].size())
        throw std::runtime_error("paged_attention_step: the scales must be whole row-contiguous arrays");
    }
    QuantPools quant{k_pool.data<uint32_t>(), v_pool.data<uint32_t>(), step[7].data<uint16_t>(), step[8].data<uint16_t>(),
                     step[9].data<uint16_t>(), step[10].data<uint16_t>(), k_pool.shape(2) * 32 / D};
    go(static_cast<float*>(nullptr), static_cast<float*>(nullptr), &quant);
  } else if (k_pool.dtype() == mx::float16) go(const_cast<uint16_t*>(k_pool.data<uint16_t>()), const_cast<uint16_t*>(v_pool.data<uint16_t>()));
  else go(const_cast<float*>(k_pool.data<float>()), const_cast<float*>(v_pool.data<float>()));
}

// An int32 array as the kernels read it: itself when already computed, int32 and
// row-contiguous (block tables and lengths are made so once a step: no op per layer).
mx::array int32_rows(const mx::array& a, const mx::Stream& stream) {
  if (a.dtype() == mx::int32 && a.status() != mx::array::Status::unscheduled && a.flags().row_contiguous) return a;
  return mx::contiguous(mx::astype(a, mx::int32, stream), false, stream);
}

// Attention of one query position per row, see the file comment. `mask`: None, or an array
// that reshapes to (1 or B, S), bool or floating (additive).
mx::array decode_attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                              const std::optional<mx::array>& mask, int threads) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || q.shape(2) != 1) {
    throw std::invalid_argument("decode_attention: one query position: q must be (B, H, 1, D), k and v (B, KVH, S, D)");
  }
  int B = q.shape(0), H = q.shape(1), D = q.shape(3), KVH = k.shape(1), S = k.shape(2);
  if (k.shape() != v.shape() || k.shape(0) != B || k.shape(3) != D || KVH < 1 || H % KVH || H / KVH > kMaxGroup ||
      D % 16 || D > kMaxHeadDim) {
    throw std::invalid_argument("decode_attention: unsupported shapes (head dim a multiple of 16 up to 256, at most 16 "
                                "query heads per KV head)");
  }
  auto stream = cpu_stream();
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, stream); };
  std::vector<mx::array> inputs = {f32(q), f32(k), f32(v)};
  int flags = 0;
  if (mask) {
    auto m = *mask;
    if (m.ndim() < 1 || m.shape(-1) != S || (m.size() != static_cast<size_t>(S) && m.size() != static_cast<size_t>(B) * S) ||
        (m.ndim() > 1 && m.shape(0) * S != static_cast<int>(m.size()))) {
      throw std::invalid_argument("decode_attention: mask must reshape to (1 or B, S)");
    }
    int rows = static_cast<int>(m.size() / S);
    if (m.dtype() == mx::bool_) {
      flags |= kMaskBool;
      inputs.push_back(mx::contiguous(mx::reshape(m, {rows, S}, stream), false, stream));
    } else {
      flags |= kMaskAdditive;
      inputs.push_back(mx::contiguous(f32(mx::reshape(m, {rows, S}, stream)), false, stream));
    }
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<DecodeAttentionCPU>(stream, DecodeParams{scale, flags, std::max(threads, 1)}),
                   std::move(inputs));
}

// Paged decode attention, see the file comment: q (B, H, L, D); k_pool, v_pool (N, KVH, D);
// table (B, M) int32 block ids; lengths (B,) int32 tokens per row (L = 1), or (B, L): the
// tokens each query position sees; window > 0: each sees only the last `window` of them.
// Quantized pools: k_pool, v_pool uint32 codes (N, KVH, D * bits / 32), `scales` the K scales
// and biases and the V scales and biases, float16 (N, KVH, D / 32), bits 8 or 4.
mx::array paged_decode_attention_op(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                                    const mx::array& table, const mx::array& lengths, int block_size, float scale,
                                    int threads, int window, const std::optional<std::vector<mx::array>>& scales, int bits) {
  bool per_position = q.ndim() == 4 && lengths.ndim() == 2 && lengths.shape(1) == q.shape(2);
  if (q.ndim() != 4 || k_pool.ndim() != 3 || k_pool.shape() != v_pool.shape() || table.ndim() != 2 ||
      !(per_position || (lengths.ndim() == 1 && q.shape(2) == 1)) || table.shape(0) != q.shape(0) ||
      lengths.shape(0) != q.shape(0) || block_size < 1 || window < 0) {
    throw std::invalid_argument("paged_decode_attention: q (B, H, L, D), pools (N, KVH, D), table (B, M), lengths (B,) "
                                "for L = 1 or (B, L)");
  }
  int H = q.shape(1), D = q.shape(3), KVH = k_pool.shape(1);
  bool quantized = k_pool.dtype() == mx::uint32;
  if ((quantized ? bits != 8 && bits != 4 : bits != 0) || (quantized != (scales && !scales->empty()))) {
    throw std::invalid_argument("paged_decode_attention: uint32 pools (quantized) take scales and bits 8 or 4, others neither");
  }
  int width = quantized ? D * bits / 32 : D;  // the pools' last axis
  if (k_pool.shape(2) != width || KVH < 1 || H % KVH || H / KVH > kMaxGroup || D % (quantized ? kQuantGroup : 16) ||
      D > kMaxHeadDim) {
    throw std::invalid_argument("paged_decode_attention: unsupported shapes (head dim a multiple of 16 up to 256, of 32 for "
                                "quantized pools, at most 16 query heads per KV head)");
  }
  auto stream = cpu_stream();
  auto f32 = [&](const mx::array& a) { return mx::contiguous(mx::astype(a, mx::float32, stream), false, stream); };
  if (k_pool.dtype() != v_pool.dtype() || (k_pool.dtype() != mx::float32 && k_pool.dtype() != mx::float16 && !quantized)) {
    throw std::invalid_argument("paged_decode_attention: the pools must be both float32, both float16 or both uint32 codes "
                                "(a cast would copy them every call)");
  }
  std::vector<mx::array> inputs = {f32(q), k_pool, v_pool, int32_rows(table, stream), int32_rows(lengths, stream)};
  if (quantized) {
    mx::Shape shape{k_pool.shape(0), KVH, D / kQuantGroup};
    if (scales->size() != 4) throw std::invalid_argument("paged_decode_attention: scales: K scales, K biases, V scales, V biases");
    for (const auto& a : *scales) {
      if (a.dtype() != mx::float16 || a.shape() != shape)
        throw std::invalid_argument("paged_decode_attention: scales and biases float16 (N, KVH, D / 32)");
      inputs.push_back(a);
    }
  }
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<PagedDecodeAttentionCPU>(stream, PagedParams{scale, block_size, std::max(threads, 1), window, bits}),
                   std::move(inputs));
}


// See attention_step.h.
std::vector<mx::array> step_inputs(const char* op, int B, int L, const StepParams& p, const mx::array& k_pool,
                                   const mx::array& v_pool, const mx::array& slots, const mx::array& table,
                                   const mx::array& limits, const mx::array& offset, const mx::array& inv_freq,
                                   const mx::Stream& stream, const std::optional<std::vector<mx::array>>& scales) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(std::string(op) + ": " + what); };
  if (k_pool.ndim() != 3 || k_pool.shape() != v_pool.shape() || table.ndim() != 2 || p.heads < 1 || p.block_size < 1) {
    fail("pools (N, KVH, D) of one shape, table (B, M), heads and block_size at least 1");
  }
  int KVH = k_pool.shape(1), D = k_pool.shape(2);
  const bool quantized = k_pool.dtype() == mx::uint32 && v_pool.dtype() == mx::uint32;
  if (quantized != (scales && !scales->empty())) fail("uint32 pools (quantized) take scales, others none");
  if (quantized) {  // codes (N, KVH, D * bits / 32); scales [K scales, K biases, V scales, V biases] float16 (N, KVH, D / 32)
    if (scales->size() != 4 || (*scales)[0].ndim() != 3) fail("scales: K scales, K biases, V scales, V biases (N, KVH, D / 32)");
    D = (*scales)[0].shape(2) * kQuantGroup;
    mx::Shape shape{k_pool.shape(0), KVH, D / kQuantGroup};
    for (const auto& a : *scales)
      if (a.dtype() != mx::float16 || a.shape() != shape) fail("scales and biases float16 (N, KVH, D / 32)");
    if (k_pool.shape(2) * 32 != D * 8 && k_pool.shape(2) * 32 != D * 4) fail("quantized pools of 8 or 4 bits");
  }
  if (KVH < 1 || p.heads % KVH || p.heads / KVH > kMaxGroup || D % 16 || D > kMaxHeadDim || table.shape(0) != B ||
      slots.size() != static_cast<size_t>(B) * L || offset.size() != static_cast<size_t>(B) ||
      !(limits.shape() == mx::Shape{B, L} || (L == 1 && limits.shape() == mx::Shape{B}))) {
    fail("unsupported shapes (head dim a multiple of 16 up to 256, at most 16 query heads per KV head; slots B * L, "
         "offset B, limits (B,) or (B, L))");
  }
  if (p.rope_dims <= 0 || p.rope_dims % 2 || p.rope_dims > D || inv_freq.ndim() != 1 || inv_freq.shape(0) != p.rope_dims / 2 ||
      inv_freq.dtype() != mx::float32) {
    fail("rope_dims even and at most D, inv_freq (rope_dims / 2,) float32");
  }
  if (k_pool.dtype() != v_pool.dtype() || (k_pool.dtype() != mx::float32 && k_pool.dtype() != mx::float16 && !quantized)) {
    fail("the pools must be both float32, both float16 or both uint32 codes");
  }
  std::vector<mx::array> out = {k_pool, v_pool, int32_rows(slots, stream), int32_rows(table, stream), int32_rows(limits, stream),
                                int32_rows(offset, stream), inv_freq};
  if (quantized) out.insert(out.end(), scales->begin(), scales->end());
  return out;
}

// The fused attention step, see PagedAttentionStepCPU: q (B, L, heads * D), k and v (B, L,
// KVH * D) float32; pools (N, KVH, D) float32 or float16, written at slots (B * L,); table
// (B, M); limits (B,) for L = 1 or (B, L); offset (B,) each row's first new position (RoPE);
// inv_freq (rope_dims / 2,) float32. Returns (B, L, heads * D) float32.
mx::array paged_attention_step_op(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& k_pool,
                                  const mx::array& v_pool, const mx::array& slots, const mx::array& table,
                                  const mx::array& limits, const mx::array& offset, const mx::array& inv_freq, int heads,
                                  int rope_dims, bool traditional, float rope_scale, int block_size, float scale, int threads,
                                  const std::optional<std::vector<mx::array>>& scales) {
  if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3 || k_pool.ndim() != 3 || heads < 1 || q.shape(2) % heads) {
    throw std::invalid_argument("paged_attention_step: q (B, L, heads * D), k and v (B, L, KVH * D), pools (N, KVH, D)");
  }
  int B = q.shape(0), L = q.shape(1), D = q.shape(2) / heads;
  mx::Shape kv_shape{B, L, k_pool.shape(1) * D};
  bool quantized = scales && !scales->empty();
  if (k.shape() != kv_shape || v.shape() != kv_shape || (!quantized && k_pool.shape(2) != D) ||
      (quantized && (*scales)[0].ndim() == 3 && (*scales)[0].shape(2) * kQuantGroup != D)) {
    throw std::invalid_argument("paged_attention_step: k and v (B, L, KVH * D), the pools' D q's width / heads");
  }
  auto stream = cpu_stream();
  StepParams p{scale, rope_scale, block_size, std::max(threads, 1), heads, rope_dims, traditional};
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, stream); };
  std::vector<mx::array> inputs = {f32(q), f32(k), f32(v)};
  for (auto& a : step_inputs("paged_attention_step", B, L, p, k_pool, v_pool, slots, table, limits, offset, inv_freq, stream, scales))
    inputs.push_back(std::move(a));
  return mx::array(q.shape(), mx::float32, std::make_shared<PagedAttentionStepCPU>(stream, p), std::move(inputs));
}

}  // namespace mlx_parallm
