/* y = x @ W.T for rows of x and affine-quantized W (MLX's layout), on the CPU.
 *
 * W is N x K, stored as MLX's quantize() writes it: `bits` (4 or 8) per element packed
 * little-endian (element j of a row at bits j*bits.. of the row's byte stream), and per group of
 * `group` elements a scale and a bias, w = scale * q + bias. x is M x K float32, y is M x N.
 *
 * Decoding a few rows reads every weight once per step, so the step is bound by memory traffic
 * and by the work of unpacking: 4-bit weights move an eighth of float32's bytes. Each 32-weight
 * chunk of a row is dequantized to float32 once (w = q * scale + bias, what the float32 copy of
 * the weights holds) and used for up to MAX_ROWS rows of x, so the kernel computes what a
 * float32 GEMM over the dequantized weights does, up to the order of the additions.
 *
 * Two paths: AVX2 + FMA intrinsics (x86 without AVX-512: GCC's generic 64-byte vectors split
 * into scalar conversions there, ~3x slower), and GCC vector extensions for the rest, which
 * lower to AVX-512 on x86 and NEON on ARM. Rows of W are split across threads (see the pool
 * below). Many rows of x (batched decode) take qmatmul_gemm.h's panels instead (qgemm_panels);
 * the int8 path is qmatmul_int8.h's (qmatmul_tiles.h's on CPUs with AVX-512 VNNI, and AMX; there also
 * with 16-bit activations, qmatmul_x16).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define QM_AVX2 1
#endif

#include "qmatmul_int8.h"
#include "qmatmul_tiles.h"
#include "qmatmul_gemm.h"

#define MAX_ROWS 8        /* rows of x one weight row is multiplied with at a time (registers) */
#define MAX_CALL_ROWS 64  /* rows of x one call takes; larger inputs belong to a GEMM */

/* x deinterleaved per 32-element chunk for 4-bit weights: a byte holds elements 2i (low
 * nibble) and 2i+1 (high nibble), so evens go first, then odds. 8-bit keeps x as is. */
static void prepare_x(const float *x, int M, int K, int bits, float *xd) {
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
    }
}

#ifdef QM_AVX2
/* One weight row times M (<= MAX_ROWS) rows of x; out[m * ldy]. */
static inline __attribute__((always_inline)) void dot_row(const uint8_t *w, const float *scales, const float *biases,
        const float *xd, int M, int K, int bits, int group, float *out, size_t ldy) {
    __m256 acc[MAX_ROWS], acc2[MAX_ROWS];  /* two chains per row: FMA latency, not throughput, bounds one row */
    for (int m = 0; m < M; m++) acc[m] = acc2[m] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int g = 0; g < K / group; g++) {
        __m256 s = _mm256_set1_ps(scales[g]), b = _mm256_set1_ps(biases[g]);
        for (int c = g * group; c < (g + 1) * group; c += 32) {
            __m256 w0, w1, w2, w3;  /* the chunk in x's order (deinterleaved for 4-bit) */
            if (bits == 4) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(w + c / 2));
                __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                w0 = gemm_dequant8(lo, s, b);
                w1 = gemm_dequant8(_mm_srli_si128(lo, 8), s, b);
                w2 = gemm_dequant8(hi, s, b);
                w3 = gemm_dequant8(_mm_srli_si128(hi, 8), s, b);
            } else {
                const uint8_t *p = w + c;
                w0 = gemm_dequant8(_mm_loadl_epi64((const __m128i *)p), s, b);
                w1 = gemm_dequant8(_mm_loadl_epi64((const __m128i *)(p + 8)), s, b);
                w2 = gemm_dequant8(_mm_loadl_epi64((const __m128i *)(p + 16)), s, b);
                w3 = gemm_dequant8(_mm_loadl_epi64((const __m128i *)(p + 24)), s, b);
            }
            for (int m = 0; m < M; m++) {
                const float *xr = xd + (size_t)m * K + c;
                acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[m]);
                acc2[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc2[m]);
                acc[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), acc[m]);
                acc2[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), acc2[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) out[(size_t)m * ldy] = hsum8(_mm256_add_ps(acc[m], acc2[m]));
}
#else
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
#else
    return __builtin_convertvector(__builtin_convertvector(b, v16i), v16f);
#endif
}

#if defined(__AVX512F__)
/* The 16 values a group's 4-bit weights can take, table[q] = q * s + b. */
static inline __m512 levels16(float s, float b) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(q, _mm512_set1_ps(s), _mm512_set1_ps(b));
}

/* 16 4-bit weights dequantized by table: lane i is table[nibbles[i] & 15] (the permute reads
 * each index's low 4 bits: no masking). A permute (port 5) replaces the int-to-float
 * conversion and the dequantizing FMA (port 0, which the products' FMAs need): the same
 * values bit for bit; the default model's one-row matmuls 9.0 -> 8.2 ms a step (the panels,
 * which dequantize once for many rows, gained nothing so). */
static inline __m512 lookup16(__m512 table, __m128i nibbles) {
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), table);
}
#endif

/* The sum of v's 16 lanes by halving (lane j + j+8, then j + j+4, ...): a tree of 4 dependent
 * adds, where a lane-by-lane sum was 16 (the default model's matmuls at 8 rows 32.0 -> 29.1 ms
 * with the two chains of dot_row). */
static inline float hsum(v16f v) {
    typedef float v8f __attribute__((vector_size(32)));
    typedef float v4f __attribute__((vector_size(16)));
    v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* One weight row times M (<= MAX_ROWS) rows of x; out[m * ldy]. */
static inline __attribute__((always_inline)) void dot_row(const uint8_t *w, const float *scales, const float *biases,
        const float *xd, int M, int K, int bits, int group, float *out, size_t ldy) {
    v16f acc[MAX_ROWS], acc2[MAX_ROWS];  /* two chains per row, one FMA each a chunk (no multiply, then add) */
    for (int m = 0; m < M; m++) acc[m] = acc2[m] = (v16f){0};
    for (int g = 0; g < K / group; g++) {
        float s = scales[g], b = biases[g];
#if defined(__AVX512F__)
        __m512 table = levels16(s, b);  /* (4-bit weights by table: lookup16) */
#endif
        for (int c = g * group; c < (g + 1) * group; c += bits == 4 ? 32 : 16) {
            if (bits == 4) {
                v16u8 raw = *(const v16u8_u *)(w + c / 2);
#if defined(__AVX512F__)
                v16f lo = (v16f)lookup16(table, (__m128i)raw);
                v16f hi = (v16f)lookup16(table, _mm_srli_epi16((__m128i)raw, 4));
#else
                v16f lo = to_float(raw & 15) * s + b;
                v16f hi = to_float(raw >> 4) * s + b;
#endif
                for (int m = 0; m < M; m++) {
                    const float *xr = xd + (size_t)m * K + c;
                    acc[m] += lo * *(const v16f_u *)xr;
                    acc2[m] += hi * *(const v16f_u *)(xr + 16);
                }
            } else {
                v16f q = to_float(*(const v16u8_u *)(w + c)) * s + b;
                for (int m = 0; m < M; m++) acc[m] += q * *(const v16f_u *)(xd + (size_t)m * K + c);
            }
        }
    }
    for (int m = 0; m < M; m++) out[(size_t)m * ldy] = hsum(acc[m] + acc2[m]);
}
#endif

/* Whether the kernels read this layout: 4- or 8-bit, groups of a multiple of 32, K whole groups. */
static int readable(int M, int K, int bits, int group) {
    return M >= 1 && (bits == 4 || bits == 8) && group > 0 && group % 32 == 0 && K % group == 0;
}

static void dequantize_rows(const uint8_t *w, const float *scales, const float *biases, int n0, int rows, int K,
                            int bits, int group, float *out);

/* One call's work, shared out by chunks of rows_per_chunk weight rows: y = x @ W.T over rows
 * [0, N) (MULTIPLY; MULTIPLY_INT8 from x quantized; MULTIPLY_PANELS for many rows of x,
 * qmatmul_gemm.h), or rows [first, first + N) of W
 * dequantized into y, N x K (DEQUANTIZE); or call(ctx, n0, n1) over items [0, N) (CALL: the
 * attention kernels' rows, qm_parallel_for). */
enum { MULTIPLY, MULTIPLY_INT8, DEQUANTIZE, MULTIPLY_PANELS, CALL };
typedef struct {
    int kind;
    const float *xd;
    const int8_t *xq;           /* MULTIPLY_INT8: x quantized (quantize_rows) */
    const float *xscale, *xsum;
    const uint8_t *w;
    const float *scales, *biases;
    float *y;
    int M, K, N, bits, group, rows_per_chunk, chunks, first;
    void (*call)(void *ctx, int n0, int n1);  /* CALL */
    void *ctx;
    int tiles, amx;  /* MULTIPLY_INT8 over tiles of 16 weight rows (qmatmul_tiles.h), on AMX: chunks in 16s */
    int planes;      /* MULTIPLY_INT8: 1, x in int8; 2, in 16 bits as two int8 planes (tiles only) */
} Job;

/* Ask for weight row n + PREFETCH_ROWS (its packed bytes, scales and biases) while row n is
 * computed: left to the hardware prefetcher, a one-row call over weights in the last-level
 * cache ran at half this speed (three short streams a row, each row's compute too short to
 * hide the misses). A macro: GCC 12 dropped these prefetches from an inline function. */
#define PREFETCH_ROWS 4
#define PREFETCH_ROW(wr, sr, br, row_bytes, G) do { \
        for (size_t o_ = 0; o_ < (row_bytes); o_ += 64) __builtin_prefetch((wr) + PREFETCH_ROWS * (row_bytes) + o_); \
        for (size_t o_ = 0; o_ < (size_t)(G) * sizeof(float); o_ += 64) { \
            __builtin_prefetch((const char *)((sr) + PREFETCH_ROWS * (G)) + o_); \
            __builtin_prefetch((const char *)((br) + PREFETCH_ROWS * (G)) + o_); \
        } \
    } while (0)

static void run_rows(const Job *j, int n0, int n1) {
    int G = j->K / j->group;
    size_t row_bytes = (size_t)j->K * j->bits / 8;
    for (int n = n0; n < n1; n++) {
        const uint8_t *wr = j->w + (size_t)n * row_bytes;
        const float *sr = j->scales + (size_t)n * G, *br = j->biases + (size_t)n * G;
        if (n + PREFETCH_ROWS < n1) PREFETCH_ROW(wr, sr, br, row_bytes, G);
        for (int m0 = 0; m0 < j->M; m0 += MAX_ROWS) {
            int rows = j->M - m0 < MAX_ROWS ? j->M - m0 : MAX_ROWS;
            const float *xr = j->xd + (size_t)m0 * j->K;
            float *out = j->y + (size_t)m0 * j->N + n;
            /* A constant row count lets the compiler keep the accumulators in registers. */
            switch ((j->bits == 4 ? 0 : 100) + rows) {
#define ROWS(r) \
            case r: dot_row(wr, sr, br, xr, r, j->K, 4, j->group, out, j->N); break; \
            case 100 + r: dot_row(wr, sr, br, xr, r, j->K, 8, j->group, out, j->N); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
            }
        }
    }
}

/* Weight rows [n0, n1) times every row of x, Q8_ROWS rows of x at a time; the tile of x stays
 * in the first-level cache while the chunk's weight rows pass over it. */
static void run_rows_int8(const Job *j, int n0, int n1) {
#ifdef QM_TILES
    if (j->tiles && tile_rows(j->amx, j->planes, j->xq, j->xscale, j->xsum, j->M, j->K, j->w, j->scales, j->biases, j->N, j->bits, j->group, n0, n1, j->y))
        return;
#endif
    int B = j->K / QBLOCK, G = j->K / j->group;
    size_t row_bytes = (size_t)j->K * j->bits / 8;
    for (int m0 = 0; m0 < j->M; m0 += Q8_ROWS) {
        int rows = j->M - m0 < Q8_ROWS ? j->M - m0 : Q8_ROWS;
        const int8_t *xq = j->xq + (size_t)m0 * j->K;
        const float *xd = j->xscale + (size_t)m0 * B * 8, *xs = j->xsum + (size_t)m0 * G;
        for (int n = n0; n < n1; n++) {
            const uint8_t *wr = j->w + (size_t)n * row_bytes;
            const float *sr = j->scales + (size_t)n * G, *br = j->biases + (size_t)n * G;
            float *out = j->y + (size_t)m0 * j->N + n;
            if (n + PREFETCH_ROWS < n1) PREFETCH_ROW(wr, sr, br, row_bytes, G);
            /* A constant row count lets the compiler keep the accumulators in registers. */
            switch ((j->bits == 4 ? 0 : 100) + rows) {
#define ROWS(r) \
            case r: dot_row_q8(wr, sr, br, xq, xd, xs, r, j->K, 4, j->group, out, j->N); break; \
            case 100 + r: dot_row_q8(wr, sr, br, xq, xd, xs, r, j->K, 8, j->group, out, j->N); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if Q8_ROWS >= 8
            ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
#if Q8_ROWS == 16
            ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#endif
#undef ROWS
            }
        }
    }
}

/* Weight rows [n0, n1) in panels (qmatmul_gemm.h), through this thread's panel buffer. */
static void run_rows_panels(const Job *j, int n0, int n1) {
    static __thread float *panel;
    static __thread size_t capacity;
    size_t need = (size_t)PANEL_FLOATS * j->K;
    if (need > capacity) {
        float *grown = realloc(panel, sizeof(float) * need);
        if (!grown) {  /* no buffer: the same products, a weight row at a time */
            run_rows(j, n0, n1);
            return;
        }
        panel = grown, capacity = need;
    }
    gemm_rows(j->xd, j->M, j->K, j->w, j->scales, j->biases, j->N, j->bits, j->group, n0, n1, j->y, panel);
}

static void run_chunk(const Job *j, int n0, int n1) {
    if (j->kind == MULTIPLY)
        run_rows(j, n0, n1);
    else if (j->kind == MULTIPLY_INT8)
        run_rows_int8(j, n0, n1);
    else if (j->kind == MULTIPLY_PANELS)
        run_rows_panels(j, n0, n1);
    else if (j->kind == CALL)
        j->call(j->ctx, n0, n1);
    else
        dequantize_rows(j->w, j->scales, j->biases, j->first + n0, n1 - n0, j->K, j->bits, j->group, j->y + (size_t)n0 * j->K);
}

/* The pool: helper threads that claim chunks of the caller's job, never a barrier.
 *
 * OpenMP's fork/join waits for every thread at the end of a call; on a loaded machine one
 * descheduled thread stalled every call (20 s instead of 2.8 s for 64 tokens at 2 threads).
 * Here the caller posts the job, wakes the helpers and claims chunks itself; a helper that
 * wakes late finds the chunks taken and does nothing, so the caller waits only for chunks a
 * helper is already computing. A chunk is claimed with one compare-and-swap on a word that
 * holds the job's number and the next chunk, so a helper holding a finished job's number can
 * claim nothing of the next one. Helpers wait ~100 us for the next job (calls come back to
 * back within a step), yielding often, and then sleep. One caller at a time: a second
 * concurrent caller (another engine's thread) computes its call alone, as does a child after
 * fork (it has no helpers; locks are only tried, so one copied locked cannot hang it). */
#define MAX_HELPERS 15
#define SPIN_NS 100000  /* how long a helper waits for the next job before it sleeps */

#define CLOSED 0xFFFFFFFFu  /* the next chunk of a finished job: nothing left to claim */

static Job pool_job;                  /* written only while no chunk of it can be claimed */
static _Atomic int pool_chunks;       /* pool_job.chunks, read by helpers that may be stale */
static _Atomic uint64_t pool_claims;  /* job number << 32 | next chunk */
static _Atomic int pool_done;         /* chunks finished in the current job */
static _Atomic int pool_wanted;       /* helpers the current job may use (the first ones) */
static _Atomic uint32_t pool_posted;  /* the latest job number */
static pthread_mutex_t pool_caller = PTHREAD_MUTEX_INITIALIZER, pool_sleep = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake[MAX_HELPERS];  /* one per helper: a call wakes only those it may use */
static int pool_helpers, pool_asleep[MAX_HELPERS];

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void claim_chunks(uint32_t job) {
    for (;;) {
        uint64_t word = atomic_load(&pool_claims);
        uint32_t next = (uint32_t)word;
        if ((uint32_t)(word >> 32) != job || next >= (uint32_t)atomic_load_explicit(&pool_chunks, memory_order_relaxed))
            return;
        if (!atomic_compare_exchange_weak(&pool_claims, &word, word + 1))
            continue;
        int n0 = (int)next * pool_job.rows_per_chunk;
        int n1 = n0 + pool_job.rows_per_chunk < pool_job.N ? n0 + pool_job.rows_per_chunk : pool_job.N;
        run_chunk(&pool_job, n0, n1);
        atomic_fetch_add(&pool_done, 1);
    }
}

static void *helper_main(void *arg) {
    int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool_posted);
    for (;;) {
        uint32_t job = atomic_load(&pool_posted);
        if (job == seen && index < atomic_load(&pool_wanted)) {
            /* Short bursts of pause instructions with a yield every few: on an idle core the
             * next job is picked up within a microsecond or two; on a loaded one the threads
             * doing the step's other work (or other processes) get the core meanwhile. */
            struct timespec start, now;
            clock_gettime(CLOCK_MONOTONIC, &start);
            int round = 0;
            do {
                for (int i = 0; i < 64; i++) cpu_relax();
                if (++round % 8 == 0) sched_yield();
                job = atomic_load(&pool_posted);
                clock_gettime(CLOCK_MONOTONIC, &now);
            } while (job == seen && (now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) < SPIN_NS);
        }
        if (job == seen || index >= atomic_load(&pool_wanted)) {  /* sleep until a job that may use this helper */
            pthread_mutex_lock(&pool_sleep);
            pool_asleep[index] = 1;
            while ((job = atomic_load(&pool_posted)) == seen || index >= atomic_load(&pool_wanted)) {
                seen = job;
                pthread_cond_wait(&pool_wake[index], &pool_sleep);
            }
            pool_asleep[index] = 0;
            pthread_mutex_unlock(&pool_sleep);
        }
        seen = job;
        claim_chunks(job);
    }
    return NULL;
}

/* Start helpers up to `wanted` (called with pool_caller held); fewer where threads cannot be had. */
static void grow_pool(int wanted) {
    wanted = wanted > MAX_HELPERS ? MAX_HELPERS : wanted;
    while (pool_helpers < wanted) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_cond_init(&pool_wake[pool_helpers], NULL);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, helper_main, (void *)(intptr_t)pool_helpers);
        pthread_attr_destroy(&attr);
        if (failed) return;
        pool_helpers++;
    }
}

/* Run `job` on this thread and up to threads - 1 helpers. */
static void run_job(const Job *job, int threads) {
    if (threads <= 1 || job->chunks <= 1 || pthread_mutex_trylock(&pool_caller) != 0) {
        run_chunk(job, 0, job->N);
        return;
    }
    grow_pool(threads - 1);
    pool_job = *job;
    atomic_store(&pool_chunks, job->chunks);
    atomic_store(&pool_done, 0);
    atomic_store(&pool_wanted, threads - 1);
    uint32_t number = atomic_load(&pool_posted) + 1;
    atomic_store(&pool_claims, (uint64_t)number << 32);
    atomic_store(&pool_posted, number);
    if (pthread_mutex_trylock(&pool_sleep) == 0) {  /* else a helper holds it: it sees the job or misses only this one */
        for (int i = 0; i < threads - 1 && i < pool_helpers; i++)
            if (pool_asleep[i]) pthread_cond_signal(&pool_wake[i]);
        pthread_mutex_unlock(&pool_sleep);
    }
    claim_chunks(number);
    for (long spin = 0; atomic_load(&pool_done) < job->chunks; spin++)
        if (spin & 63) cpu_relax(); else sched_yield();  /* a helper is inside its last chunk */
    /* Closed before pool_job can change: a helper that read this job's last word before it
     * finished would otherwise claim a chunk of fields being rewritten for the next one. */
    atomic_store(&pool_claims, (uint64_t)number << 32 | CLOSED);
    pthread_mutex_unlock(&pool_caller);
}

/* fn(ctx, i, i + 1) for every item i in [0, items), on this thread and up to threads - 1 of the
 * pool's helpers (which stay warm between the step's matmuls): the decode attention kernels'
 * rows. Starting a thread for each call cost them ~0.1 ms on a 2-core VM, more than the
 * attention of 8 short rows. fn must not throw. */
void qm_parallel_for(int items, int threads, void (*fn)(void *, int, int), void *ctx) {
    Job job = {CALL};
    job.N = job.chunks = items;
    job.rows_per_chunk = 1;
    job.call = fn, job.ctx = ctx;
    run_job(&job, threads < items ? threads : items);
}

/* Weight rows per chunk of a call whose weight rows meet `tile_rows` rows of x at a time: ~64 KB
 * of weights per row of x, small enough to share out, large enough that claiming a chunk costs
 * nothing beside computing it. */
static int chunk_rows(int tile_rows, int K, int bits) {
    int rows = (int)((size_t)65536 / tile_rows / ((size_t)K * bits / 8));
    return rows < 8 ? 8 : rows;
}

/* Returns 0, or -1 for arguments this kernel does not handle (the caller falls back) or when
 * memory for x's copy cannot be had. */
int qmatmul(const float *x, int M, int K, const uint8_t *w, const float *scales,
            const float *biases, int N, int bits, int group, float *y, int threads) {
    if (M > MAX_CALL_ROWS || !readable(M, K, bits, group))
        return -1;
    float *xd = malloc(sizeof(float) * (size_t)M * K);
    if (!xd) return -1;
    prepare_x(x, M, K, bits, xd);
    int rows_per_chunk = chunk_rows(M < MAX_ROWS ? M : MAX_ROWS, K, bits);
    Job job = {MULTIPLY, xd, NULL, NULL, NULL, w, scales, biases, y, M, K, N, bits, group, rows_per_chunk, (N + rows_per_chunk - 1) / rows_per_chunk, 0};
    run_job(&job, threads);
    free(xd);
    return 0;
}

/* y = x @ W.T for any number of rows of x quantized in blocks of 32, to int8 (planes 1) or to
 * 16 bits as two int8 planes (planes 2, qmatmul_tiles.h's tiles only): no float32 weights at
 * all. Returns 0, or -1 for arguments it does not handle or without memory. */
static int multiply_quantized(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *biases,
                              int N, int bits, int group, float *y, int threads, int planes) {
    if (!readable(M, K, bits, group))
        return -1;
#ifdef QM_TILES
    int tiles = 1, amx = amx_enabled();
#else
    int tiles = 0, amx = 0;
    if (planes != 1) return -1;
#endif
    /* AMX loads whole tiles of 16 rows of x: its copy is padded with zero rows */
    size_t rows = (size_t)M * planes, padded = amx ? (rows + 15) / 16 * 16 : rows;
    int8_t *xq = malloc(padded * K);
    if (xq) memset(xq + rows * K, 0, (padded - rows) * K);
    float *xscale = malloc(sizeof(float) * (size_t)M * (K / QBLOCK) * 8), *xsum = malloc(sizeof(float) * (size_t)((M + XS_TILE - 1) / XS_TILE * XS_TILE) * (K / group));
    if (!xq || !xscale || !xsum) {
        free(xq), free(xscale), free(xsum);
        return -1;
    }
#ifdef QM_TILES
    if (planes == 2)
        quantize_rows_x16(x, M, K, bits, group, xq, xscale, xsum);
    else
#endif
        quantize_rows(x, M, K, bits, group, xq, xscale, xsum);
    int rows_per_chunk = chunk_rows(M < Q8_ROWS ? M : Q8_ROWS, K, bits);
    if (tiles) rows_per_chunk = (rows_per_chunk + 15) / 16 * 16;
    Job job = {MULTIPLY_INT8, NULL, xq, xscale, xsum, w, scales, biases, y, M, K, N, bits, group, rows_per_chunk,
               (N + rows_per_chunk - 1) / rows_per_chunk, 0};
    job.tiles = tiles, job.amx = amx, job.planes = planes;
    run_job(&job, threads);
    free(xq), free(xscale), free(xsum);
    return 0;
}

/* y = x @ W.T for any number of rows of x, quantized to int8 (qmatmul_int8.h; qmatmul_tiles.h
 * on AVX-512 VNNI). Returns 0, or -1 for arguments it does not handle or without memory. */
int qmatmul_int8(const float *x, int M, int K, const uint8_t *w, const float *scales,
                 const float *biases, int N, int bits, int group, float *y, int threads) {
    return multiply_quantized(x, M, K, w, scales, biases, N, bits, group, y, threads, 1);
}

/* The same with x quantized to 16 bits (two int8 planes, qmatmul_tiles.h): -1 where the build
 * has no tiles (CPUs without AVX-512 VNNI). */
int qmatmul_x16(const float *x, int M, int K, const uint8_t *w, const float *scales,
                const float *biases, int N, int bits, int group, float *y, int threads) {
    return multiply_quantized(x, M, K, w, scales, biases, N, bits, group, y, threads, 2);
}

/* Whether the int8 path uses AMX (qmatmul_tiles.h): request < 0 asks (the first call asks Linux
 * for it), 0 turns it off, 1 back on where Linux gives it. Returns 1
 * when in use, 0 when not (or not built: no AMX on this CPU). */
int qm_amx(int request) {
#ifdef QM_AMX
    if (request == 0) atomic_store(&amx_state, 0);
    else if (request > 0) atomic_store(&amx_state, amx_permitted());
    return amx_enabled();
#else
    (void)request;
    return 0;
#endif
}

/* Which int8 path this build has: 1 qmatmul_tiles.h's tiles (AVX-512 VNNI), 0 qmatmul_int8.h's lanes. */
int qm_int8_tiles(void) {
#ifdef QM_TILES
    return 1;
#else
    return 0;
#endif
}

/* y = x @ W.T for any number of rows of x, over the packed weights (qmatmul_gemm.h's panels,
 * shared out to `threads` threads). Returns 0, or -1 for arguments it does not handle or
 * without memory. */
int qgemm_panels(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *biases, int N,
                 int bits, int group, float *y, int threads) {
    if (!readable(M, K, bits, group))
        return -1;
    float *xd = malloc(sizeof(float) * (size_t)M * K);
    if (!xd) return -1;
    prepare_x(x, M, K, bits, xd);
    int per_chunk = PANEL_ROWS * 4;
    Job job = {MULTIPLY_PANELS, xd, NULL, NULL, NULL, w, scales, biases, y, M, K, N, bits, group, per_chunk, (N + per_chunk - 1) / per_chunk, 0};
    run_job(&job, threads);
    free(xd);
    return 0;
}

/* cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), LP64 ints. */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

/* Weight rows [n0, n0 + rows) dequantized to float32, in element order, into out (rows x K). */
static void dequantize_rows(const uint8_t *w, const float *scales, const float *biases, int n0, int rows, int K,
                            int bits, int group, float *out) {
    int G = K / group;
    size_t row_bytes = (size_t)K * bits / 8;
    for (int r = 0; r < rows; r++) {
        const uint8_t *wr = w + (size_t)(n0 + r) * row_bytes;
        const float *sr = scales + (size_t)(n0 + r) * G, *br = biases + (size_t)(n0 + r) * G;
        float *o = out + (size_t)r * K;
        for (int g = 0; g < G; g++) {
            float s = sr[g], b = br[g];
            int k0 = g * group;
#ifdef QM_AVX2
            __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
            if (bits == 4) {
                const __m128i low = _mm_set1_epi8(0x0F);
                for (int k = k0; k < k0 + group; k += 32) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(wr + k / 2));
                    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                    __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);  /* element order */
                    _mm256_storeu_ps(o + k, gemm_dequant8(e0, sv, bv));
                    _mm256_storeu_ps(o + k + 8, gemm_dequant8(_mm_srli_si128(e0, 8), sv, bv));
                    _mm256_storeu_ps(o + k + 16, gemm_dequant8(e1, sv, bv));
                    _mm256_storeu_ps(o + k + 24, gemm_dequant8(_mm_srli_si128(e1, 8), sv, bv));
                }
            } else {
                for (int k = k0; k < k0 + group; k += 8)
                    _mm256_storeu_ps(o + k, gemm_dequant8(_mm_loadl_epi64((const __m128i *)(wr + k)), sv, bv));
            }
#else
            for (int k = k0; k < k0 + group; k++) {
                int q = bits == 4 ? (wr[k / 2] >> (4 * (k & 1))) & 15 : wr[k];
                o[k] = (float)q * s + b;
            }
#endif
        }
    }
}

/* y = x @ W.T for many rows of x: W dequantized `tile` rows at a time (on `threads` threads)
 * into a float32 buffer that stays in cache, each tile multiplied through `sgemm` (the
 * caller's BLAS), so no float32 copy of W is kept. Returns 0, or -1 for arguments it does not
 * handle or without memory. */
int qgemm(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *biases, int N,
          int bits, int group, float *y, void *sgemm, int tile, int threads) {
    if (!readable(M, K, bits, group) || !sgemm || tile < 1)
        return -1;
    float *buffer = malloc(sizeof(float) * (size_t)tile * K);
    if (!buffer) return -1;
    sgemm_fn gemm = (sgemm_fn)sgemm;
    for (int n0 = 0; n0 < N; n0 += tile) {
        int rows = N - n0 < tile ? N - n0 : tile;
        int per_chunk = (int)((size_t)65536 / ((size_t)K * bits / 8)) + 1;  /* ~64 KB of packed weights */
        Job job = {DEQUANTIZE, NULL, NULL, NULL, NULL, w, scales, biases, buffer, 0, K, rows, bits, group, per_chunk, (rows + per_chunk - 1) / per_chunk, n0};
        run_job(&job, threads);
        gemm(101, 111, 112, M, rows, K, 1.0f, x, K, buffer, K, 0.0f, y + n0, N);  /* row-major, x @ tile.T */
    }
    free(buffer);
    return 0;
}
