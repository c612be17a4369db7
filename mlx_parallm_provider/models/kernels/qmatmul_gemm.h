/* The many-row path of qmatmul.c: y = x @ W.T over the packed weights, no float32 copy of W.
 *
 * A panel of PANEL_ROWS weight rows is dequantized (w = q * scale + bias, what a float32 copy
 * holds) into a buffer that stays in the core's caches, and every row of x is multiplied by
 * it there. The dequantizing is paid once per panel for all rows of x, and W is read packed
 * (4-bit: an eighth of float32's bytes). Panels are shared out to the pool's threads. x comes
 * deinterleaved as qmatmul.c's prepare_x writes it, and the panel is stored in the same order.
 *
 * With AVX2 (no AVX-512) the panel is stored transposed and multiplied by outer products, as
 * BLAS kernels do: a tile of the panel's 16 weight rows x OTILE_X rows of x
 * keeps accumulators whose lanes are outputs; per k, the panel's 16 weights are loaded once
 * and each row of x's value broadcast, so there are no horizontal sums and enough independent
 * chains to keep both of AVX2's FMA ports busy. Each output is one chain of FMAs over k, the
 * same whatever the other rows of x: a row's outputs do not depend on the rows beside it.
 * Elsewhere (AVX-512, NEON, portable builds) a register tile of TILE_W weight rows x TILE_X rows of x
 * keeps one vector of partial sums over K an output, reduced at the end.
 */
#ifndef QMATMUL_GEMM_H
#define QMATMUL_GEMM_H

#include <stdint.h>
#include <stdlib.h>

#define PANEL_ROWS 16
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GEMM_OUTER 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* 8 bytes (the low ones of `bytes`) as floats, q * scale + bias (also qmatmul.c's AVX2 path). */
static inline __m256 gemm_dequant8(__m128i bytes, __m256 scale, __m256 bias) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), scale, bias);
}
#endif

/* 16 values dequantized, out[i] = q[i] * s + b: from 16 packed bytes' low (nibble 0) or high
 * (nibble 1) nibbles, or 16 bytes (nibble -1, 8-bit). */
static inline void gemm_dequant16(const uint8_t *p, int nibble, float s, float b, float *out) {
#if defined(__AVX512F__)
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    if (nibble >= 0) raw = _mm_and_si128(nibble ? _mm_srli_epi16(raw, 4) : raw, _mm_set1_epi8(0x0F));
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
    _mm512_storeu_ps(out, _mm512_fmadd_ps(q, _mm512_set1_ps(s), _mm512_set1_ps(b)));
#elif defined(__AVX2__) && defined(__FMA__)
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    if (nibble >= 0) raw = _mm_and_si128(nibble ? _mm_srli_epi16(raw, 4) : raw, _mm_set1_epi8(0x0F));
    __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
    _mm256_storeu_ps(out, gemm_dequant8(raw, sv, bv));
    _mm256_storeu_ps(out + 8, gemm_dequant8(_mm_srli_si128(raw, 8), sv, bv));
#else
    for (int i = 0; i < 16; i++) {
        int q = nibble < 0 ? p[i] : nibble ? p[i] >> 4 : p[i] & 15;
        out[i] = (float)q * s + b;
    }
#endif
}

/* Weight rows [n0, n0 + rows) dequantized into panel (rows x K), each 32-element chunk of a
 * 4-bit row deinterleaved (its even elements, then its odd ones), as x is. */
static void gemm_panel(const uint8_t *w, const float *scales, const float *biases, int n0, int rows, int K,
                       int bits, int group, float *panel) {
    int G = K / group;
    size_t row_bytes = (size_t)K * bits / 8;
    for (int r = 0; r < rows; r++) {
        const uint8_t *wr = w + (size_t)(n0 + r) * row_bytes;
        const float *sr = scales + (size_t)(n0 + r) * G, *br = biases + (size_t)(n0 + r) * G;
        float *o = panel + (size_t)r * K;
        for (int g = 0; g < G; g++) {
            float s = sr[g], b = br[g];
            for (int c = g * group; c < (g + 1) * group; c += bits == 4 ? 32 : 16) {
                if (bits == 4) {  /* even elements (low nibbles), then odd ones */
                    gemm_dequant16(wr + c / 2, 0, s, b, o + c);
                    gemm_dequant16(wr + c / 2, 1, s, b, o + c + 16);
                } else {
                    gemm_dequant16(wr + c, -1, s, b, o + c);
                }
            }
        }
    }
}

#ifdef GEMM_OUTER
#define PANEL_FLOATS (2 * PANEL_ROWS)  /* a panel buffer: gemm_panel's rows, then the transposed panel */

/* The 8 x 8 block at src (rows src_ld apart) written transposed at dst (rows dst_ld apart). */
static inline void gemm_transpose8(const float *src, size_t src_ld, float *dst, size_t dst_ld) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_ld);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    /* r[i] (i < 4): column i of rows 0-3 | column i + 4 of rows 0-3; r[i + 4]: the same of rows 4-7 */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * dst_ld, t[i]);
}

/* panel (rows x K, as gemm_panel writes it, rows up to PANEL_ROWS) transposed into panel_t
 * (K x PANEL_ROWS), missing rows zero: a call's last, partial panel. */
static void gemm_panel_t(const float *panel, int rows, int K, float *panel_t) {
    for (int h = 0; h < PANEL_ROWS; h += 8) {
        if (h + 8 <= rows) {
            for (int k = 0; k < K; k += 8)
                gemm_transpose8(panel + (size_t)h * K + k, K, panel_t + (size_t)k * PANEL_ROWS + h, PANEL_ROWS);
        } else {
            for (int k = 0; k < K; k++)
                for (int i = h; i < h + 8; i++) panel_t[(size_t)k * PANEL_ROWS + i] = i < rows ? panel[(size_t)i * K + k] : 0.0f;
        }
    }
}

/* The 16 bytes at `rows` of 8 rows (row_bytes apart) transposed: a[j] holds byte 2j of the
 * 8 rows in its low 8 bytes and byte 2j + 1 in its high 8. */
static inline void gemm_bytes8(const uint8_t *rows, size_t row_bytes, __m128i a[8]) {
    __m128i r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm_loadu_si128((const __m128i *)(rows + i * row_bytes));
    for (int i = 0; i < 8; i += 2) {  /* a[i]: bytes 0-7 of rows i, i + 1 interleaved; a[i + 1]: bytes 8-15 */
        a[i] = _mm_unpacklo_epi8(r[i], r[i + 1]);
        a[i + 1] = _mm_unpackhi_epi8(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  /* rows i..i+3, 4 bytes each: bytes 0-3, 4-7, 8-11, 12-15 */
        r[i] = _mm_unpacklo_epi16(a[i], a[i + 2]);
        r[i + 1] = _mm_unpackhi_epi16(a[i], a[i + 2]);
        r[i + 2] = _mm_unpacklo_epi16(a[i + 1], a[i + 3]);
        r[i + 3] = _mm_unpackhi_epi16(a[i + 1], a[i + 3]);
    }
    for (int j = 0; j < 4; j++) {  /* bytes 4j, 4j + 1 of the 8 rows; then 4j + 2, 4j + 3 */
        a[2 * j] = _mm_unpacklo_epi32(r[j], r[j + 4]);
        a[2 * j + 1] = _mm_unpackhi_epi32(r[j], r[j + 4]);
    }
}

/* A full panel of weight rows [n0, n0 + PANEL_ROWS) dequantized straight into panel_t
 * (K x PANEL_ROWS): each 16 bytes of the rows transposed first, so every vector dequantized
 * is one k's weights (the same q * scale + bias as gemm_panel's; fewer instructions than
 * dequantizing rows and transposing floats). 4-bit: in a 32-element chunk, byte i's low
 * nibble is k = c + i and its high nibble k = c + 16 + i (x's deinterleaved order); 8-bit:
 * byte i is k = c + i. */
static void gemm_panel_tq(const uint8_t *w, const float *scales, const float *biases, int n0, int K, int bits,
                          int group, float *panel_t) {
    int G = K / group, step = bits == 4 ? 32 : 16;  /* elements in 16 bytes of a row */
    size_t row_bytes = (size_t)K * bits / 8;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int h = 0; h < PANEL_ROWS; h += 8) {
        for (int g = 0; g < G; g++) {
            float sg[8], bg[8];
            for (int r = 0; r < 8; r++) sg[r] = scales[(size_t)(n0 + h + r) * G + g], bg[r] = biases[(size_t)(n0 + h + r) * G + g];
            __m256 sv = _mm256_loadu_ps(sg), bv = _mm256_loadu_ps(bg);
            for (int c = g * group; c < (g + 1) * group; c += step) {
                __m128i a[8];
                gemm_bytes8(w + (size_t)(n0 + h) * row_bytes + (size_t)c * bits / 8, row_bytes, a);
                for (int j = 0; j < 8; j++) {  /* bytes 2j, 2j + 1 of the 8 rows */
                    float *o = panel_t + (size_t)(c + 2 * j) * PANEL_ROWS + h;
                    if (bits == 8) {
                        _mm256_storeu_ps(o, gemm_dequant8(a[j], sv, bv));
                        _mm256_storeu_ps(o + PANEL_ROWS, gemm_dequant8(_mm_srli_si128(a[j], 8), sv, bv));
                        continue;
                    }
                    __m128i lo = _mm_and_si128(a[j], low), hi = _mm_and_si128(_mm_srli_epi16(a[j], 4), low);
                    _mm256_storeu_ps(o, gemm_dequant8(lo, sv, bv));
                    _mm256_storeu_ps(o + PANEL_ROWS, gemm_dequant8(_mm_srli_si128(lo, 8), sv, bv));
                    _mm256_storeu_ps(o + 16 * PANEL_ROWS, gemm_dequant8(hi, sv, bv));
                    _mm256_storeu_ps(o + 17 * PANEL_ROWS, gemm_dequant8(_mm_srli_si128(hi, 8), sv, bv));
                }
            }
        }
    }
}

/* The panel's rows (panel_t, K x PANEL_ROWS) times mx (<= OTILE_X) rows of x: the first
 * `rows` outputs of y[m * ldy ...]. Named accumulators: in an array GCC stored every one to
 * the stack at each k. */
#define OTILE_X 6  /* 2 x 6 accumulators (8 outputs each) + 2 weight vectors + 1 of x: 15 of 16 registers */
static inline __attribute__((always_inline)) void gemm_otile(const float *panel_t, const float *xd, int K, int mx,
                                                              int rows, float *y, size_t ldy) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0, b4 = a0,
           a5 = a0, b5 = a0;
    const float *x0 = xd, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K, *x4 = x3 + K, *x5 = x4 + K;
    for (int k = 0; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(panel_t + (size_t)k * PANEL_ROWS), w1 = _mm256_loadu_ps(panel_t + (size_t)k * PANEL_ROWS + 8);
#define OTILE_ROW(i) if (mx > i) { \
            __m256 xv = _mm256_broadcast_ss(x##i + k); \
            a##i = _mm256_fmadd_ps(w0, xv, a##i); \
            b##i = _mm256_fmadd_ps(w1, xv, b##i); \
        }
        OTILE_ROW(0) OTILE_ROW(1) OTILE_ROW(2) OTILE_ROW(3) OTILE_ROW(4) OTILE_ROW(5)
#undef OTILE_ROW
    }
    __m256 sums[OTILE_X][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
    for (int m = 0; m < mx; m++) {
        if (rows == PANEL_ROWS) {
            _mm256_storeu_ps(y + (size_t)m * ldy, sums[m][0]);
            _mm256_storeu_ps(y + (size_t)m * ldy + 8, sums[m][1]);
        } else {
            float out[PANEL_ROWS];
            _mm256_storeu_ps(out, sums[m][0]);
            _mm256_storeu_ps(out + 8, sums[m][1]);
            for (int i = 0; i < rows; i++) y[(size_t)m * ldy + i] = out[i];
        }
    }
}

/* Weight rows [n0, n1) times every row of x (M x K, deinterleaved): y (M x N). panel: a
 * buffer of PANEL_FLOATS x K floats. */
static void gemm_rows(const float *xd, int M, int K, const uint8_t *w, const float *scales, const float *biases,
                      int N, int bits, int group, int n0, int n1, float *y, float *panel) {
    float *panel_t = panel + (size_t)PANEL_ROWS * K;
    for (int p = n0; p < n1; p += PANEL_ROWS) {
        int rows = n1 - p < PANEL_ROWS ? n1 - p : PANEL_ROWS;
        if (rows == PANEL_ROWS) {
            gemm_panel_tq(w, scales, biases, p, K, bits, group, panel_t);
        } else {
            gemm_panel(w, scales, biases, p, rows, K, bits, group, panel);
            gemm_panel_t(panel, rows, K, panel_t);
        }
        for (int m0 = 0; m0 < M; m0 += OTILE_X) {
            const float *xr = xd + (size_t)m0 * K;
            float *out = y + (size_t)m0 * N + p;
            /* A constant row count keeps the accumulators in registers. */
            switch (M - m0 < OTILE_X ? M - m0 : OTILE_X) {
#define OTILE_CASE(r) case r: gemm_otile(panel_t, xr, K, r, rows, out, N); break;
                OTILE_CASE(1) OTILE_CASE(2) OTILE_CASE(3) OTILE_CASE(4) OTILE_CASE(5)
#undef OTILE_CASE
                default: gemm_otile(panel_t, xr, K, OTILE_X, rows, out, N); break;
            }
        }
    }
}
#else
#define PANEL_FLOATS PANEL_ROWS  /* a panel buffer holds PANEL_ROWS x K floats */
#if defined(__AVX512F__)
#define GV 16      /* floats a vector */
#define TILE_W 4   /* 4 x 6 accumulators + 4 weight vectors + 1 of x: 29 of 32 registers */
#define TILE_X 6
#else
#define GV 8       /* floats a vector (NEON: two registers) */
#define TILE_W 2   /* 2 x 4 accumulators + 2 weight vectors + 1 of x: 11 of 16 registers */
#define TILE_X 4
#endif
typedef float gvec __attribute__((vector_size(GV * 4)));
typedef float gvec_u __attribute__((vector_size(GV * 4), aligned(4), may_alias));

static inline float gemm_hsum(gvec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < GV; i++) s += v[i];
    return s;
#endif
}

/* nw (<= TILE_W) panel rows times mx (<= TILE_X) rows of x: y[m * ldy + i]. */
static inline __attribute__((always_inline)) void gemm_tile(const float *panel, const float *xd, int K, int nw, int mx,
                                                             float *y, size_t ldy) {
    gvec acc[TILE_W][TILE_X];
    for (int i = 0; i < nw; i++)
        for (int m = 0; m < mx; m++) acc[i][m] = (gvec){0};
    for (int k = 0; k < K; k += GV) {
        gvec wv[TILE_W];
        for (int i = 0; i < nw; i++) wv[i] = *(const gvec_u *)(panel + (size_t)i * K + k);
        for (int m = 0; m < mx; m++) {
            gvec xv = *(const gvec_u *)(xd + (size_t)m * K + k);
            for (int i = 0; i < nw; i++) acc[i][m] += wv[i] * xv;
        }
    }
    for (int m = 0; m < mx; m++)
        for (int i = 0; i < nw; i++) y[(size_t)m * ldy + i] = gemm_hsum(acc[i][m]);
}

/* Weight rows [n0, n1) times every row of x (M x K, deinterleaved): y (M x N). panel: a
 * buffer of PANEL_FLOATS x K floats. */
static void gemm_rows(const float *xd, int M, int K, const uint8_t *w, const float *scales, const float *biases,
                      int N, int bits, int group, int n0, int n1, float *y, float *panel) {
    for (int p = n0; p < n1; p += PANEL_ROWS) {
        int rows = n1 - p < PANEL_ROWS ? n1 - p : PANEL_ROWS;
        gemm_panel(w, scales, biases, p, rows, K, bits, group, panel);
        for (int m0 = 0; m0 < M; m0 += TILE_X) {
            int mx = M - m0 < TILE_X ? M - m0 : TILE_X;
            for (int i0 = 0; i0 < rows; i0 += TILE_W) {
                int nw = rows - i0 < TILE_W ? rows - i0 : TILE_W;
                const float *pw = panel + (size_t)i0 * K;
                const float *xr = xd + (size_t)m0 * K;
                float *out = y + (size_t)m0 * N + p + i0;
                /* Constant tile sizes keep the accumulators in registers. */
                if (nw == TILE_W && mx == TILE_X) gemm_tile(pw, xr, K, TILE_W, TILE_X, out, N);
                else if (nw == TILE_W) {
                    switch (mx) {
                        case 1: gemm_tile(pw, xr, K, TILE_W, 1, out, N); break;
                        case 2: gemm_tile(pw, xr, K, TILE_W, 2, out, N); break;
                        case 3: gemm_tile(pw, xr, K, TILE_W, 3, out, N); break;
#if TILE_X > 4
                        case 4: gemm_tile(pw, xr, K, TILE_W, 4, out, N); break;
                        case 5: gemm_tile(pw, xr, K, TILE_W, 5, out, N); break;
#endif
                        default: break;
                    }
                } else {
                    for (int i = 0; i < nw; i++)
                        for (int m = 0; m < mx; m++) gemm_tile(pw + (size_t)i * K, xr + (size_t)m * K, K, 1, 1, out + (size_t)m * N + i, N);
                }
            }
        }
    }
}
#endif

#endif
