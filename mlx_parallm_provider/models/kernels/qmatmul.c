/* y = x @ W.T for a few rows of x and affine-quantized W (MLX's layout), on the CPU.
 *
 * W is N x K, stored as MLX's quantize() writes it: `bits` (4 or 8) per element packed
 * little-endian (element j of a row at bits j*bits.. of the row's byte stream), and per group of
 * `group` elements a scale and a bias, w = scale * q + bias. x is M x K float32, y is M x N.
 *
 * Decoding one token reads every weight once per step, so at a handful of rows the step is
 * bound by memory traffic: 4-bit weights move an eighth of float32's bytes. Each 16-byte chunk
 * of a row is unpacked once and used for all M rows of x. Written with GCC vector extensions,
 * which lower to AVX-512/AVX2 on x86 and NEON on ARM; rows of W are split across OpenMP threads.
 */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8

typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
/* Unaligned views for loads: with memcpy into a vector, GCC splits 8-bit loads into scalars. */
typedef uint8_t v16u8_u __attribute__((vector_size(16), aligned(1), may_alias));
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));

/* Bytes to floats in two steps (zero-extend, then int to float): GCC turns a direct
 * uint8 -> float conversion into one scalar conversion per element. */
static inline v16f to_float(v16u8 b) {
#if defined(__AVX512F__)  /* GCC scalarizes the generic form for whole bytes */
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b));
#elif defined(__AVX2__)
    __m128i bytes = (__m128i)b;
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
    v16f out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
#else
    return __builtin_convertvector(__builtin_convertvector(b, v16i), v16f);
#endif
}

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* x deinterleaved per 32-element chunk for 4-bit weights: a byte holds elements 2i (low
 * nibble) and 2i+1 (high nibble), so evens go first, then odds. 8-bit keeps x as is. */
static void prepare_x(const float *x, int M, int K, int bits, int group, float *xd, float *xsum) {
    int G = K / group;
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        float *dr = xd + (size_t)m * K;
        if (bits == 4) {
            for (int c = 0; c < K; c += 32)
                for (int i = 0; i < 16; i++) {
                    dr[c + i] = xr[c + 2 * i];
                    dr[c + 16 + i] = xr[c + 2 * i + 1];
                }
        } else {
            memcpy(dr, xr, sizeof(float) * K);
        }
        for (int g = 0; g < G; g++) {
            float s = 0.0f;
            for (int i = 0; i < group; i++) s += xr[g * group + i];
            xsum[m * G + g] = s;
        }
    }
}

static inline __attribute__((always_inline)) void row4(const uint8_t *w, const float *scales, const float *biases, const float *xd,
                 const float *xsum, int M, int K, int group, float *out, int N) {
    v16f acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = (v16f){0};
    for (int g = 0; g < K / group; g++) {
        float s = scales[g];
        for (int c = g * group; c < (g + 1) * group; c += 32) {
            v16u8 b = *(const v16u8_u *)(w + c / 2);
            v16f lo = to_float(b & 15) * s;
            v16f hi = to_float(b >> 4) * s;
            for (int m = 0; m < M; m++) {
                v16f xe = *(const v16f_u *)(xd + (size_t)m * K + c);
                v16f xo = *(const v16f_u *)(xd + (size_t)m * K + c + 16);
                acc[m] += lo * xe + hi * xo;
            }
        }
    }
    int G = K / group;
    for (int m = 0; m < M; m++) {
        float b = 0.0f;
        for (int g = 0; g < G; g++) b += biases[g] * xsum[m * G + g];
        out[(size_t)m * N] = hsum(acc[m]) + b;
    }
}

static inline __attribute__((always_inline)) void row8(const uint8_t *w, const float *scales, const float *biases, const float *xd,
                 const float *xsum, int M, int K, int group, float *out, int N) {
    v16f acc[MAX_ROWS];
    for (int m = 0; m < M; m++) acc[m] = (v16f){0};
    for (int g = 0; g < K / group; g++) {
        float s = scales[g];
        for (int c = g * group; c < (g + 1) * group; c += 16) {
            v16u8 b = *(const v16u8_u *)(w + c);
            v16f q = to_float(b) * s;
            for (int m = 0; m < M; m++) {
                v16f xv = *(const v16f_u *)(xd + (size_t)m * K + c);
                acc[m] += q * xv;
            }
        }
    }
    int G = K / group;
    for (int m = 0; m < M; m++) {
        float b = 0.0f;
        for (int g = 0; g < G; g++) b += biases[g] * xsum[m * G + g];
        out[(size_t)m * N] = hsum(acc[m]) + b;
    }
}

/* Returns 0, or -1 for arguments this kernel does not handle (the caller falls back). */
int qmatmul(const float *x, int M, int K, const uint8_t *w, const float *scales,
            const float *biases, int N, int bits, int group, float *y, int threads) {
    if (M < 1 || M > MAX_ROWS || (bits != 4 && bits != 8) || group % 32 != 0 || K % group != 0)
        return -1;
    int G = K / group;
    float *xd = malloc(sizeof(float) * ((size_t)M * K + (size_t)M * G));
    if (!xd) return -1;
    float *xsum = xd + (size_t)M * K;
    prepare_x(x, M, K, bits, group, xd, xsum);
    size_t row_bytes = (size_t)K * bits / 8;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * row_bytes;
        const float *sr = scales + (size_t)n * G, *br = biases + (size_t)n * G;
        /* A constant row count lets the compiler keep the accumulators in registers. */
        switch ((bits == 4 ? 0 : 100) + M) {
#define ROWS(m) \
        case m: row4(wr, sr, br, xd, xsum, m, K, group, y + n, N); break; \
        case 100 + m: row8(wr, sr, br, xd, xsum, m, K, group, y + n, N); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
    }
    free(xd);
    return 0;
}
