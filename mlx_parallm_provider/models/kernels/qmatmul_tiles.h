/* The int8 path of qmatmul.c over tiles of 16 weight rows, on AVX-512 VNNI, and on Intel AMX
 * where the CPU has it (Sapphire Rapids and later).
 *
 * x is quantized as for qmatmul_int8.h (quantize_rows: blocks of 32, a float scale each, 4-bit
 * blocks deinterleaved as the nibbles are packed). Each tile of 16 weight rows is turned, block
 * by block, into AMX's B layout (8 rows of 16 x 4 bytes: dword r of each weight row's block side
 * by side; a 16 x 4 dword transpose), once per call, for every row of x. Then a block's int32
 * sums for 16 weight rows come either from 8 `vpdpbusd` (B row r times x's elements 4r..4r+3
 * broadcast: lane n holds weight row n's sum) or, for 12 to 16 rows of x at once, from one AMX
 * `tdpbsud` (int8 x times uint8 weights). Both give the exact sums, and each output is then
 * accumulated by the same AVX-512 operations in the same order whatever the rows beside it
 * (per group: each block's sum times its weight scale times its x scale, then the group's bias
 * times its sum of x). So a row's result does not depend on the call's other rows (batched ==
 * alone, exactly), nor on whether the tiles ran on AMX. Against qmatmul_int8.h's lanes (the
 * path of CPUs without AVX-512 VNNI) only the float order of the blocks differs.
 *
 * With 16-bit activations (planes = 2: qmatmul_x16), x is quantized per block of 32 to 15-bit
 * integers q (d = max|x| / 32512) and stored as two int8 planes, q = 256 * hi + lo (hi, lo in
 * -128..127; plane rows 2m and 2m + 1 for row m): both planes meet the same B tiles, and the
 * block sum 256 * (w . hi) + (w . lo) is w . q exactly. Twice the integer products of the int8
 * path, the same float work; the rounding error of x ~256x smaller (near the float path's
 * numerics; bench/int8_numerics.py measures both).
 *
 * The weights stay in MLX's packed layout. Linux gives a process AMX's register state only when
 * asked (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+); where it refuses (an older kernel, a
 * signal stack too small for the larger state), `vpdpbusd` computes every tile.
 * qm_amx(0) turns AMX off (Python calls it right after loading the kernel where
 * DeviceConfig.amx is False, before any int8 call).
 */
#ifndef QMATMUL_TILES_H
#define QMATMUL_TILES_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && XS_TILE == 16
#define QM_TILES 1
#include <immintrin.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QM_AMX 1
#endif

#define AMX_ROWS 16         /* rows of x (and weight rows) a tile holds */
#define AMX_TILE_BYTES 512  /* a B tile: 16 weight rows x 32 elements */
#define DIRECT_ROWS 4       /* rows of x at most whose sums are taken from B tiles in registers */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 12     /* fewer rows of x in a tile: vpdpbusd (tile_vnni_sums), the same sums (faster at 8 rows) */
#endif

#ifdef QM_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* 1: tiles in use, 0: not (refused, or turned off); -1: not asked yet. */
static _Atomic int amx_state = -1;

/* Whether Linux gives this process the tiles' state: ARCH_REQ_XCOMP_PERM (0x1023) for
 * XFEATURE_XTILEDATA (18). */
static int amx_permitted(void) {
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

static int amx_enabled(void) {
    int state = atomic_load(&amx_state);
    if (state < 0) {
        int expected = -1;
        atomic_compare_exchange_strong(&amx_state, &expected, amx_permitted());
        state = atomic_load(&amx_state);
    }
    return state;
}

/* tmm0 / tmm3: sums (16 x 16 int32), tmm1 / tmm4: x (16 rows x 32 int8), tmm2 / tmm5: weights
 * (8 x 64 uint8): two blocks at a time. */
static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = 16, c.colsb[t] = 64;
        c.rows[t + 1] = 16, c.colsb[t + 1] = 32;
        c.rows[t + 2] = 8, c.colsb[t + 2] = 64;
    }
    _tile_loadconfig(&c);
}
#else
static int amx_enabled(void) { return 0; }
#endif

/* Dword r (0-3) of 16 bytes at base + n * stride for weight rows n < rows (0 past them), as
 * out[r]'s lane n: a 16 x 4 dword transpose. */
static inline void tile_transpose16x4(const uint8_t *base, size_t stride, int rows, __m512i out[4]) {
    __m512i z[4];
    for (int k = 0; k < 4; k++) {
#define LANE(L) (4 * k + (L) < rows ? _mm_loadu_si128((const __m128i *)(base + (size_t)(4 * k + (L)) * stride)) : _mm_setzero_si128())
        __m512i v = _mm512_castsi128_si512(LANE(0));
        v = _mm512_inserti32x4(v, LANE(1), 1);
        v = _mm512_inserti32x4(v, LANE(2), 2);
        z[k] = _mm512_inserti32x4(v, LANE(3), 3);
#undef LANE
    }
    /* lane L of z[k] is row 4k + L; after the unpacks, lane L of u[r] holds dword r of rows L,
     * 4 + L, 8 + L, 12 + L; the permute puts row n at dword n. */
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    out[0] = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(t0, t2));
    out[1] = _mm512_permutexvar_epi32(order, _mm512_unpackhi_epi64(t0, t2));
    out[2] = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(t1, t3));
    out[3] = _mm512_permutexvar_epi32(order, _mm512_unpackhi_epi64(t1, t3));
}

/* Block blk of weight rows [0, rows) of w as a B tile's 8 rows, in registers: row r holds, for
 * each weight row n, the 4 weights that meet x's quantized elements 4r..4r+3 of the block (x's
 * deinterleaved order for 4-bit: low nibbles of bytes 4r.. for r < 4, high nibbles of bytes
 * 4(r-4).. after). */
static inline __attribute__((always_inline)) void tile_block(const uint8_t *w, size_t row_bytes, int rows, int bits, int blk,
                                                             __m512i t[8]) {
    __m512i d[4];
    if (bits == 4) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        tile_transpose16x4(w + (size_t)blk * 16, row_bytes, rows, d);
        for (int r = 0; r < 4; r++) {
            t[r] = _mm512_and_si512(d[r], low);
            t[r + 4] = _mm512_and_si512(_mm512_srli_epi16(d[r], 4), low);
        }
    } else {
        for (int half = 0; half < 2; half++) {
            tile_transpose16x4(w + (size_t)blk * 32 + 16 * half, row_bytes, rows, d);
            for (int r = 0; r < 4; r++) t[4 * half + r] = d[r];
        }
    }
}

/* The same B tile stored (AMX_TILE_BYTES at tile), for every tile of rows of x to read. */
static inline void tile_pack_block(const uint8_t *w, size_t row_bytes, int rows, int bits, int blk, uint8_t *tile) {
    __m512i t[8];
    tile_block(w, row_bytes, rows, bits, blk, t);
    for (int r = 0; r < 8; r++) _mm512_store_si512((void *)(tile + 64 * r), t[r]);
}

/* Row m's block sums (16 weight rows, in lanes) against a B tile's rows t: 8 `vpdpbusd` a plane
 * (planes 2: 256 * hi + lo, in two independent chains). x4: the row's first plane at the block. */
static inline __attribute__((always_inline)) __m512i tile_row_sums(const __m512i t[8], const int8_t *x4, int planes, int K) {
    const int32_t *h4 = (const int32_t *)x4;
    __m512i hi = _mm512_setzero_si512();
    if (planes == 1) {
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) hi = _mm512_dpbusd_epi32(hi, t[r], _mm512_set1_epi32(h4[r]));
        return hi;
    }
    const int32_t *l4 = (const int32_t *)(x4 + K);
    __m512i lo = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
        hi = _mm512_dpbusd_epi32(hi, t[r], _mm512_set1_epi32(h4[r]));
        lo = _mm512_dpbusd_epi32(lo, t[r], _mm512_set1_epi32(l4[r]));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
}

#ifdef QM_AMX
/* Tile rows of x (R of them) times the tile of weights: each block's int32 sums into
 * sums[blk * 256 + 16 * r + c] (two accumulator tiles in turn, so one's product overlaps the
 * other's store). */
static inline void amx_tile_sums(const int8_t *xq, int K, int B, const uint8_t *tiles, int32_t *sums) {
    int blk = 0;
    for (; blk + 1 < B; blk += 2) {
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, xq + (size_t)blk * QBLOCK, K);
        _tile_loadd(2, tiles + (size_t)blk * AMX_TILE_BYTES, 64);
        _tile_loadd(4, xq + (size_t)(blk + 1) * QBLOCK, K);
        _tile_loadd(5, tiles + (size_t)(blk + 1) * AMX_TILE_BYTES, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_dpbsud(3, 4, 5);
        _tile_stored(0, sums + (size_t)blk * 256, 64);
        _tile_stored(3, sums + (size_t)(blk + 1) * 256, 64);
    }
    if (blk < B) {
        _tile_zero(0);
        _tile_loadd(1, xq + (size_t)blk * QBLOCK, K);
        _tile_loadd(2, tiles + (size_t)blk * AMX_TILE_BYTES, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums + (size_t)blk * 256, 64);
    }
}
#endif

/* The same sums without AMX (or for fewer than AMX_MIN_ROWS plane rows, where a tile's fixed
 * costs are more than the rows' products): each B tile row r times x's quantized elements
 * 4r..4r+3 broadcast, by `vpdpbusd`, gives the 16 weight rows' block sums in the 16 lanes (R
 * rows of x, each of `planes` plane rows). */
static inline void tile_vnni_sums(const int8_t *xq, int R, int planes, int K, int B, const uint8_t *tiles, int32_t *sums) {
    for (int blk = 0; blk < B; blk++) {
        const uint8_t *tile = tiles + (size_t)blk * AMX_TILE_BYTES;
        __m512i t[8];
        for (int r = 0; r < 8; r++) t[r] = _mm512_load_si512((const void *)(tile + 64 * r));
        for (int m = 0; m < R; m++)
            _mm512_store_si512((void *)(sums + (size_t)blk * 256 + 16 * m),
                               tile_row_sums(t, xq + (size_t)m * planes * K + (size_t)blk * QBLOCK, planes, K));
    }
}

#ifdef QM_AMX
/* Two planes' block sums from AMX (plane rows 2r and 2r + 1, r < R) into row r's: 256 * hi + lo.
 * In place: row r is written after rows 2r and 2r + 1 (>= r) are read. */
static inline void combine_planes(int32_t *sums, int R, int B) {
    for (int blk = 0; blk < B; blk++) {
        int32_t *s = sums + (size_t)blk * 256;
        for (int r = 0; r < R; r++) {
            __m512i hi = _mm512_load_si512((const void *)(s + 32 * r)), lo = _mm512_load_si512((const void *)(s + 32 * r + 16));
            _mm512_store_si512((void *)(s + 16 * r), _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
        }
    }
}
#endif

/* The 32 elements at xb as two int8 planes of 15-bit integers (qhi, qlo; 4-bit weights'
 * deinterleaved order) and their scale 8 times into d8: q = round(x * 32512 / max|x|),
 * hi = (q + 128) >> 8, lo = q - 256 * hi. */
#define X16_LEVELS 32512.0f  /* 127 * 256: hi stays within -127..127 */
static inline void quantize_block_x16(const float *xb, int bits, int8_t *qhi, int8_t *qlo, float *d8) {
    __m512 a, b;
    float amax = load_block_avx512(xb, bits, &a, &b);
    float inv = amax > 0.0f ? X16_LEVELS / amax : 0.0f;
    __m512 scale = _mm512_set1_ps(inv);
    const __m512i half = _mm512_set1_epi32(128);
    for (int i = 0; i < 2; i++) {
        __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(i ? b : a, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, half), 8);
        __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
        _mm_storeu_si128((__m128i *)(qhi + 16 * i), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128((__m128i *)(qlo + 16 * i), _mm512_cvtepi32_epi8(lo));
    }
    _mm256_storeu_ps(d8, _mm256_set1_ps(amax / X16_LEVELS));
}

/* quantize_rows for 16-bit activations: q holds 2M plane rows (row m's hi at 2m, lo at 2m + 1);
 * d and sx as quantize_rows writes them. */
static void quantize_rows_x16(const float *x, int M, int K, int bits, int group, int8_t *q, float *d, float *sx) {
    int B = K / QBLOCK, G = K / group;
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        for (int b = 0; b < B; b++)
            quantize_block_x16(xr + b * QBLOCK, bits, q + (size_t)(2 * m) * K + b * QBLOCK, q + (size_t)(2 * m + 1) * K + b * QBLOCK,
                               d + ((size_t)m * B + b) * 8);
        group_sums(xr, m, G, group, sx);
    }
}

/* out[r * ldy + c] (c < cols) from R rows' block sums: per group, each block's sum times its
 * weight scale times its x scale, then the group's bias times its sum of x. st / sb: the tile's
 * scales and biases, group-major (16 a group). */
static inline __attribute__((always_inline)) void tile_outputs(const int32_t *sums, const float *xd, const float *xs, int R,
        int B, int G, int per_group, const float *st, const float *sb, float *out, size_t ldy, int cols) {
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 s = _mm512_loadu_ps(st + 16 * g);
        for (int b = g * per_group; b < (g + 1) * per_group; b++) {
            const int32_t *bs = sums + (size_t)b * 256;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xd[((size_t)r * B + b) * 8]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(bs + 16 * r))), sd, acc[r]);
            }
        }
        __m512 b = _mm512_loadu_ps(sb + 16 * g);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(xs[(size_t)g * XS_TILE + r]), acc[r]);
    }
    __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (size_t)r * ldy, keep, acc[r]);
}

/* Per-thread buffers: a tile of weight rows' B tiles (K / 32 of them) followed by its scales and
 * biases group-major, and a tile of rows' int32 sums (K / 32 tiles of them). */
typedef struct {
    uint8_t *tiles;
    int32_t *sums;
    size_t capacity;  /* bytes of tiles */
} tile_buffers;

static int tile_grow(tile_buffers *b, int K, int G) {
    size_t need = (size_t)(K / QBLOCK) * AMX_TILE_BYTES + (size_t)2 * 16 * G * sizeof(float);
    if (need <= b->capacity) return 1;
    free(b->tiles);
    b->tiles = aligned_alloc(64, (need + 63) / 64 * 64);
    free(b->sums);
    b->sums = aligned_alloc(64, (size_t)(K / QBLOCK) * 256 * sizeof(int32_t));
    if (!b->tiles || !b->sums) {
        b->capacity = 0;
        return 0;
    }
    b->capacity = need;
    return 1;
}

/* Weight rows [n0, n1) (n0 a multiple of 16) times every row of x, quantized as quantize_rows
 * does (planes 1) or quantize_rows_x16 (planes 2); with amx, its plane rows padded to a
 * multiple of 16 with zeros (AMX loads whole tiles). Returns 0 without memory for its buffers
 * (nothing computed). */
static int tile_rows(int amx, int planes, const int8_t *xq, const float *xscale, const float *xsum, int M, int K, const uint8_t *w,
                    const float *scales, const float *biases, int N, int bits, int group, int n0, int n1, float *y) {
    static __thread tile_buffers buf;
    int B = K / QBLOCK, G = K / group, per_group = group / QBLOCK;
    if (!tile_grow(&buf, K, G)) return 0;
    float *st = (float *)(buf.tiles + (size_t)B * AMX_TILE_BYTES), *sb = st + 16 * G;
    size_t row_bytes = (size_t)K * bits / 8;
#ifdef QM_AMX
    int tiles = amx && M * planes >= AMX_MIN_ROWS;  /* some tile of rows of x is wide enough for AMX */
    if (tiles) amx_configure();
#else
    int tiles = 0;
    (void)amx;
#endif
    size_t block_bytes = QBLOCK * bits / 8;
    /* up to DIRECT_ROWS rows of x (decode steps of a few rows): each B tile is used once, so it
     * is never stored (the same sums; 6-9% less time a call at 1-4 rows, none at 8) */
    int direct = !tiles && M <= DIRECT_ROWS;
    __m512i rows_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(G));
    for (int t = n0; t < n1; t += AMX_ROWS) {
        int cols = n1 - t < AMX_ROWS ? n1 - t : AMX_ROWS;
        const uint8_t *wt = w + (size_t)t * row_bytes;
        /* the next tile's weights asked for as this one's are packed, a line of each row at a time
         * (16 streams at once outrun the hardware prefetcher) */
        int ahead = t + AMX_ROWS < n1 ? (n1 - t - AMX_ROWS < AMX_ROWS ? n1 - t - AMX_ROWS : AMX_ROWS) : 0;
        for (size_t o = 0; o < (size_t)ahead * G * sizeof(float); o += 64) {  /* and its scales and biases */
            __builtin_prefetch((const char *)(scales + (size_t)(t + AMX_ROWS) * G) + o);
            __builtin_prefetch((const char *)(biases + (size_t)(t + AMX_ROWS) * G) + o);
        }
        for (int blk = 0; blk < B; blk++) {
            size_t offset = (size_t)blk * block_bytes;
            if (offset % 64 < block_bytes)
                for (int n = 0; n < ahead; n++) __builtin_prefetch(wt + (size_t)(AMX_ROWS + n) * row_bytes + offset);
            if (direct) {  /* the B tile stays in registers: its rows' sums at once */
                __m512i tb[8];
                tile_block(wt, row_bytes, cols, bits, blk, tb);
                for (int m = 0; m < M; m++)
                    _mm512_store_si512((void *)(buf.sums + (size_t)blk * 256 + 16 * m),
                                       tile_row_sums(tb, xq + (size_t)m * planes * K + (size_t)blk * QBLOCK, planes, K));
            } else {
                tile_pack_block(wt, row_bytes, cols, bits, blk, buf.tiles + (size_t)blk * AMX_TILE_BYTES);
            }
        }
        __mmask16 real = (__mmask16)((1u << cols) - 1);
        for (int g = 0; g < G; g++) {
            _mm512_store_ps(st + 16 * g, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, rows_at, scales + (size_t)t * G + g, 4));
            _mm512_store_ps(sb + 16 * g, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, rows_at, biases + (size_t)t * G + g, 4));
        }
        for (int m0 = 0; m0 < M; m0 += AMX_ROWS / planes) {
            int rows = M - m0 < AMX_ROWS / planes ? M - m0 : AMX_ROWS / planes;
            const int8_t *xt = xq + (size_t)m0 * planes * K;
            const float *xd = xscale + (size_t)m0 * B * 8, *xs = xsum + (size_t)(m0 / XS_TILE) * G * XS_TILE + m0 % XS_TILE;
            float *out = y + (size_t)m0 * N + t;
#ifdef QM_AMX
            if (tiles && rows * planes >= AMX_MIN_ROWS) {
                amx_tile_sums(xt, K, B, buf.tiles, buf.sums);
                if (planes == 2) combine_planes(buf.sums, rows, B);
            } else
#endif
            if (!direct)
                tile_vnni_sums(xt, rows, planes, K, B, buf.tiles, buf.sums);
            /* A constant row count lets the compiler keep the accumulators in registers. */
            switch (rows) {
#define ROWS(r) case r: tile_outputs(buf.sums, xd, xs, r, B, G, per_group, st, sb, out, N, cols); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
            ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
            }
        }
    }
#ifdef QM_AMX
    if (tiles) _tile_release();
#endif
    return 1;
}
#endif

#endif /* QMATMUL_TILES_H */
