/* The many-row path of qmatmul.c: y = x @ W.T over the packed weights, no float32 copy of W.
 *
 * A panel of PANEL_ROWS weight rows is dequantized (w = q * scale + bias, what a float32 copy
 * holds) into a buffer that stays in the core's caches, and every row of x is multiplied by
 * it there, a register tile of TILE_W weight rows x TILE_X rows of x at a time: each output
 * keeps one vector of partial sums over K, reduced at the end. The dequantizing is paid once
 * per panel for all rows of x, and W is read packed (4-bit: an eighth of float32's bytes).
 * Panels are shared out to the pool's threads. x comes deinterleaved as qmatmul.c's
 * prepare_x writes it, and the panel is stored in the same order.
 */
#ifndef QMATMUL_GEMM_H
#define QMATMUL_GEMM_H

#include <stdint.h>
#include <stdlib.h>

#define PANEL_ROWS 16
#if defined(__AVX512F__)
#define GV 16      /* floats a vector */
#define TILE_W 4   /* 4 x 6 accumulators + 4 weight vectors + 1 of x: 29 of 32 registers */
#define TILE_X 6
#else
#define GV 8       /* AVX2's 8 floats (NEON: two registers a vector) */
#define TILE_W 2   /* 2 x 4 accumulators + 2 weight vectors + 1 of x: 11 of 16 registers */
#define TILE_X 4
#endif
typedef float gvec __attribute__((vector_size(GV * 4)));
typedef float gvec_u __attribute__((vector_size(GV * 4), aligned(4), may_alias));

#if defined(__AVX512F__)
static inline float gemm_hsum(gvec v) {
    return _mm512_reduce_add_ps((__m512)v);
}
#elif defined(__AVX2__)
/* The 8 lane sums of v[0..7], in order, by a tree of hadds: 9 instructions for 8 outputs
 * (one at a time, 8 dependent scalar adds each: a 64-row step's matmuls 165.9 -> 154.4 ms). */
static inline __m256 gemm_sums8(const gvec *v) {
    __m256 t0 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), t1 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
    __m256 t2 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), t3 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* each 128-bit half: 4 outputs' partial sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
static inline float gemm_hsum(gvec v) {
    float s = 0.0f;
    for (int i = 0; i < GV; i++) s += v[i];
    return s;
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
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), sv, bv));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))), sv, bv));
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
#if defined(__AVX2__) && !defined(__AVX512F__)
    gvec flat[TILE_W * TILE_X];
    float sums[TILE_W * TILE_X];
    for (int m = 0; m < mx; m++)
        for (int i = 0; i < nw; i++) flat[m * nw + i] = acc[i][m];
    for (int j0 = 0; j0 < nw * mx; j0 += 8) {
        gvec part[8];
        for (int j = 0; j < 8; j++) part[j] = j0 + j < nw * mx ? flat[j0 + j] : (gvec){0};
        float all[8];
        _mm256_storeu_ps(all, gemm_sums8(part));
        for (int j = 0; j < 8 && j0 + j < nw * mx; j++) sums[j0 + j] = all[j];
    }
    for (int m = 0; m < mx; m++)
        for (int i = 0; i < nw; i++) y[(size_t)m * ldy + i] = sums[m * nw + i];
#else
    for (int m = 0; m < mx; m++)
        for (int i = 0; i < nw; i++) y[(size_t)m * ldy + i] = gemm_hsum(acc[i][m]);
#endif
}

/* Weight rows [n0, n1) times every row of x (M x K, deinterleaved): y (M x N). panel: a
 * buffer of PANEL_ROWS x K floats. */
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
