/* The int8 path of qmatmul.c: y = x @ W.T with x quantized to int8, at any number of rows.
 *
 * Each row of x is quantized in blocks of 32 elements (a float scale per block, d = max|x| /
 * 127, as llama.cpp's Q8 activations), and each block of 32 packed weights is multiplied by
 * its block of x with integer dot products (VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, plain integer
 * code elsewhere), so a weight is never converted to float:
 *
 *     y[m, n] = sum_g scale[n, g] * sum_{b in g} d[m, b] * (q[n, b] . xq[m, b])
 *             + sum_g bias[n, g] * (sum of x[m] over group g)
 *
 * The second line uses the float sums of x itself, so only the first is approximate. Every
 * output is computed by the same operations in the same order whatever the number of rows in
 * the call and wherever a row falls in its tile, so a row's result does not depend on the
 * rows beside it (batched == alone, exactly).
 */
#ifndef QMATMUL_INT8_H
#define QMATMUL_INT8_H

#include <math.h>
#include <stdint.h>

#include "lane_sums.h"

#define QBLOCK 32  /* elements of x per int8 scale */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define Q8_ROWS 16  /* rows of x per weight row at a time: one 16-lane accumulator each, 32 registers */
#define XS_TILE 16  /* sums of x stored per tile of rows, group-major: a vector holds a group's 16 rows */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__)
#define Q8_ROWS 8   /* two 8-lane accumulators each, 32 registers */
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_ROWS 4   /* 16 registers */
#else
#define Q8_ROWS 4
#endif
#ifndef XS_TILE
#define XS_TILE 1   /* row-major */
#endif

/* Rows of x quantized: q (M x K int8; for 4-bit weights each 32-block deinterleaved as the
 * packed nibbles are: evens, then odds), d (M x K/32 scales, each written 8 times: a vector
 * load gives a block's scale in every lane), sx (M x K/group sums of x; for XS_TILE > 1 the
 * sums of each tile of XS_TILE rows stored group by group, row m's of group g at
 * ((m / XS_TILE) * G + g) * XS_TILE + m % XS_TILE). */
#if defined(__AVX512F__)
#include <immintrin.h>
/* The 32 elements at xb into a (first 16) and b in the order the weights meet them (4-bit:
 * evens, then odds, the packed nibbles' order); returns their maximum of |x|. */
static inline float load_block_avx512(const float *xb, int bits, __m512 *a, __m512 *b) {
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    if (bits == 4) {
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        *a = _mm512_permutex2var_ps(lo, even, hi), *b = _mm512_permutex2var_ps(lo, odd, hi);
    } else {
        *a = lo, *b = hi;
    }
    return amax;
}

/* The 32 elements at xb quantized into qb (its scale 8 times into d8) with AVX-512: what the
 * scalar loop in quantize_rows computes, bit for bit (maximum of |x|, the same products,
 * rounding half to even as nearbyintf does). */
static inline void quantize_block_avx512(const float *xb, int bits, int8_t *qb, float *d8) {
    __m512 a, b;
    float amax = load_block_avx512(xb, bits, &a, &b);
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 scale = _mm512_set1_ps(inv);
    _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_mul_ps(a, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_mul_ps(b, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    _mm256_storeu_ps(d8, _mm256_set1_ps(amax / 127.0f));
}
#endif

/* Row m's sums of x (xr) over each of its G groups into sx (quantize_rows' layout). */
static inline void group_sums(const float *xr, int m, int G, int group, float *sx) {
    for (int g = 0; g < G; g++) {
        float s = 0.0f;
        for (int i = g * group; i < (g + 1) * group; i++) s += xr[i];
        sx[((size_t)(m / XS_TILE) * G + g) * XS_TILE + m % XS_TILE] = s;
    }
}

static void quantize_rows(const float *x, int M, int K, int bits, int group, int8_t *q, float *d, float *sx) {
    int B = K / QBLOCK, G = K / group;
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        for (int b = 0; b < B; b++) {
#if defined(__AVX512F__)
            quantize_block_avx512(xr + b * QBLOCK, bits, q + (size_t)m * K + b * QBLOCK, d + ((size_t)m * B + b) * 8);
#else
            const float *xb = xr + b * QBLOCK;
            float amax = 0.0f;
            for (int i = 0; i < QBLOCK; i++) {  /* (not fmaxf: a libm call per element, for its NaN rules) */
                float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *qb = q + (size_t)m * K + b * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) {
                int at = bits == 4 ? (i & 1) * 16 + i / 2 : i;
                qb[at] = (int8_t)nearbyintf(xb[i] * inv);
            }
            for (int j = 0; j < 8; j++) d[((size_t)m * B + b) * 8 + j] = amax / 127.0f;
#endif
        }
        group_sums(xr, m, G, group, sx);
    }
}

#if defined(__AVX2__) && defined(__FMA__)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 weights (0..15 or 0..255) times 32 int8 elements of x: eight int32 partial sums. */
static inline __m256i dot32(__m256i w, __m256i x, int bits) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)bits;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    (void)bits;
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
    if (bits == 4)  /* pairs of 15 * 127 cannot saturate vpmaddubsw's int16 */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    __m256i wl = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), wh = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
    __m256i xl = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)), xh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh));
#endif
}

/* 32 packed weights from element c of a row, as dot32 takes them (4-bit: low nibbles, then high). */
static inline __m256i load32(const uint8_t *w, int c, int bits) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(w + c));
    __m128i raw = _mm_loadu_si128((const __m128i *)(w + c / 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* Block blk of a weight row times block blk of M rows of x, into acc (8 lanes a row). */
static inline __attribute__((always_inline)) void block_q8(const uint8_t *w, float scale, const int8_t *xq,
        const float *xd, int M, int K, int B, int bits, int blk, __m256 *acc) {
    __m256i wv = load32(w, blk * QBLOCK, bits);
    __m256 s = _mm256_set1_ps(scale);
    for (int m = 0; m < M; m++) {
        __m256i isum = dot32(wv, _mm256_loadu_si256((const __m256i *)(xq + (size_t)m * K + blk * QBLOCK)), bits);
        __m256 sd = _mm256_mul_ps(s, _mm256_loadu_ps(xd + ((size_t)m * B + blk) * 8));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sd, acc[m]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* 64 packed weights (blocks c/32 and c/32 + 1) in the order of their two blocks of x. */
static inline __m512i load64(const uint8_t *w, int c, int bits) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(w + c));
    __m256i raw = _mm256_loadu_si256((const __m256i *)(w + c / 2)), low = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    __m512i joined = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  /* lo0 lo1 hi0 hi1 */
    return _mm512_shuffle_i64x2(joined, joined, _MM_SHUFFLE(3, 1, 2, 0));    /* lo0 hi0 lo1 hi1 */
}

/* The sum of v's 16 lanes: lane j + j+8, then j + j+4, j + j+2, j + j+1. */
static inline float reduce1(__m512 v) {
    __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
}

/* One weight row times M (<= Q8_ROWS) quantized rows of x; out[m * ldy]. Two blocks per
 * instruction: lanes 0-7 hold the first block's sums, 8-15 the second's; an odd last block
 * takes the 8-lane path. */
static inline __attribute__((always_inline)) void dot_row_q8(const uint8_t *w, const float *scales, const float *biases,
        const int8_t *xq, const float *xd, const float *xs, int M, int K, int bits, int group, float *out, size_t ldy) {
    __m512 acc[Q8_ROWS];
    __m256 tail[Q8_ROWS];
    int B = K / QBLOCK, G = K / group, per_group = group / QBLOCK;
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps(), tail[m] = _mm256_setzero_ps();
    for (int blk = 0; blk + 1 < B; blk += 2) {
        __m512i wv = load64(w, blk * QBLOCK, bits);
        __m512 s = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(scales[blk / per_group])),
                                                        _mm256_castps_pd(_mm256_set1_ps(scales[(blk + 1) / per_group])), 1));
#pragma GCC unroll 16  /* (M is a constant here: unrolled, the accumulators stay in registers) */
        for (int m = 0; m < M; m++) {
            __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512((const void *)(xq + (size_t)m * K + blk * QBLOCK)));
            __m512 sd = _mm512_mul_ps(s, _mm512_loadu_ps(xd + ((size_t)m * B + blk) * 8));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[m]);
        }
    }
    if (B % 2) {
        block_q8(w, scales[(B - 1) / per_group], xq, xd, M, K, B, bits, B - 1, tail);
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_add_ps(acc[m], _mm512_castpd_ps(_mm512_insertf64x4(_mm512_setzero_pd(), _mm256_castps_pd(tail[m]), 0)));
    }
    /* Each output: its 16 lanes summed by one tree (lane j + j+8, then j + j+4, j + j+2, j + j+1)
     * plus the bias term (fused multiply-adds in two chains, even groups and odd groups, each
     * in group order, then added: one chain of G dependent FMAs cost ~15% of a 64-row call);
     * a whole tile sums its 16 rows' lanes together (lane_sums16), a partial one row by row
     * (reduce1), the same sums. */
    if (M == Q8_ROWS) {
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        for (int g = 0; g < G; g += 2) {
            even = _mm512_fmadd_ps(_mm512_set1_ps(biases[g]), _mm512_loadu_ps(xs + (size_t)g * XS_TILE), even);
            if (g + 1 < G) odd = _mm512_fmadd_ps(_mm512_set1_ps(biases[g + 1]), _mm512_loadu_ps(xs + (size_t)(g + 1) * XS_TILE), odd);
        }
        float sums[Q8_ROWS];
        _mm512_storeu_ps(sums, _mm512_add_ps(lane_sums16(acc), _mm512_add_ps(even, odd)));
        for (int m = 0; m < M; m++) out[(size_t)m * ldy] = sums[m];
    } else {
        for (int m = 0; m < M; m++) {
            float even = 0.0f, odd = 0.0f;
            for (int g = 0; g < G; g += 2) {
                even = fmaf(biases[g], xs[(size_t)g * XS_TILE + m], even);
                if (g + 1 < G) odd = fmaf(biases[g + 1], xs[(size_t)(g + 1) * XS_TILE + m], odd);
            }
            out[(size_t)m * ldy] = reduce1(acc[m]) + (even + odd);
        }
    }
}
#else
/* Lanes whose sum is bias . xs over G groups (the rows' bias term), 8 groups at a time. */
static inline __m256 bias_lanes8(const float *biases, const float *xs, int G) {
    __m256 sum = _mm256_setzero_ps();
    for (int g = 0; g < G; g += 8) {
        if (G - g >= 8) {
            sum = _mm256_fmadd_ps(_mm256_loadu_ps(biases + g), _mm256_loadu_ps(xs + g), sum);
        } else {
            __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(G - g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            sum = _mm256_fmadd_ps(_mm256_maskload_ps(biases + g, k), _mm256_maskload_ps(xs + g, k), sum);
        }
    }
    return sum;
}

/* One weight row times M (<= Q8_ROWS) quantized rows of x; out[m * ldy]. Blocks go in pairs,
 * the first of each pair into acc0, the second into acc1 (two chains per row: FMA latency,
 * not throughput, bounds one row; fixed indices, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void dot_row_q8(const uint8_t *w, const float *scales, const float *biases,
        const int8_t *xq, const float *xd, const float *xs, int M, int K, int bits, int group, float *out, size_t ldy) {
    __m256 acc0[Q8_ROWS], acc1[Q8_ROWS];
    int B = K / QBLOCK, G = K / group, per_group = group / QBLOCK;
    for (int m = 0; m < M; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    for (int blk = 0; blk < B; blk += 2) {
        block_q8(w, scales[blk / per_group], xq, xd, M, K, B, bits, blk, acc0);
        if (blk + 1 < B) block_q8(w, scales[(blk + 1) / per_group], xq, xd, M, K, B, bits, blk + 1, acc1);
    }
    for (int m = 0; m < M; m++)
        out[(size_t)m * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(acc0[m], acc1[m]), bias_lanes8(biases, xs + (size_t)m * G, G)));
}
#endif
#else
/* Plain integer code (the compiler vectorizes it: NEON on arm64). */
static inline __attribute__((always_inline)) void dot_row_q8(const uint8_t *w, const float *scales, const float *biases,
        const int8_t *xq, const float *xd, const float *xs, int M, int K, int bits, int group, float *out, size_t ldy) {
    float acc[Q8_ROWS][2], bias_sum[Q8_ROWS];
    int B = K / QBLOCK, G = K / group;
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = bias_sum[m] = 0.0f;
    for (int g = 0; g < G; g++) {
        float s = scales[g], b = biases[g];
        for (int m = 0; m < M; m++) bias_sum[m] = fmaf(b, xs[(size_t)m * G + g], bias_sum[m]);  /* fused in every build */
        for (int c = g * group; c < (g + 1) * group; c += QBLOCK) {
            uint8_t wv[QBLOCK];
            for (int i = 0; i < QBLOCK; i++)
                wv[i] = bits == 4 ? (w[c / 2 + i % 16] >> (i < 16 ? 0 : 4)) & 15 : w[c + i];  /* low nibbles, then high */
            int blk = c / QBLOCK;
            for (int m = 0; m < M; m++) {
                const int8_t *xb = xq + (size_t)m * K + c;
                int32_t isum = 0;
                for (int i = 0; i < QBLOCK; i++) isum += (int32_t)wv[i] * xb[i];
                acc[m][blk & 1] = fmaf((float)isum, s * xd[((size_t)m * B + blk) * 8], acc[m][blk & 1]);
            }
        }
    }
    for (int m = 0; m < M; m++) out[(size_t)m * ldy] = acc[m][0] + acc[m][1] + bias_sum[m];
}
#endif

#endif /* QMATMUL_INT8_H */
