/* Sums of the 16 lanes of 16 AVX-512 vectors at once, shared by the int8 matmul
 * (qmatmul_int8.h: a tile's 16 rows) and the decode attention (decode_attention.cpp: a tile's
 * 16 key positions). Each sum is the tree _mm512_reduce_add_ps adds one vector by (lane j +
 * j+8, then j + j+4, j + j+2, j + j+1), so it equals that vector's _mm512_reduce_add_ps bit
 * for bit; 15 two-vector folds instead of 16 separate reductions. AVX2 builds: the 8 lane
 * sums of 8 vectors by a tree of hadds (lane_sums8). C and C++. */
#ifndef LANE_SUMS_H
#define LANE_SUMS_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lanes j of a and b, for j in `lo`, beside lanes j of a and b for j in `hi` (indices into a
 * then b: 0-15 a, 16-31 b), added. */
static inline __m512 lane_fold(__m512 a, __m512 b, __m512i lo, __m512i hi) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

/* The 16 lane sums of v[0..15], in order. */
static inline __m512 lane_sums16(const __m512 *v) {
    const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i hi1 = _mm512_add_epi32(lo1, _mm512_set1_epi32(8)), hi2 = _mm512_add_epi32(lo2, _mm512_set1_epi32(4));
    const __m512i hi3 = _mm512_add_epi32(lo3, _mm512_set1_epi32(2)), hi4 = _mm512_add_epi32(lo4, _mm512_set1_epi32(1));
    __m512 r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++) r1[i] = lane_fold(v[2 * i], v[2 * i + 1], lo1, hi1);   /* 8 partials of 2 vectors */
    for (int i = 0; i < 4; i++) r2[i] = lane_fold(r1[2 * i], r1[2 * i + 1], lo2, hi2);  /* 4 partials of 4 vectors */
    for (int i = 0; i < 2; i++) r3[i] = lane_fold(r2[2 * i], r2[2 * i + 1], lo3, hi3);  /* 2 partials of 8 vectors */
    return lane_fold(r3[0], r3[1], lo4, hi4);
}
#elif defined(__AVX2__)
#include <immintrin.h>

/* The 8 lane sums of v[0..7], in order: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of
 * each, by 7 hadds / permutes and one add. */
static inline __m256 lane_sums8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* each 128-bit half: 4 vectors' partial sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#endif /* LANE_SUMS_H */
