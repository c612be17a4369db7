/* A standalone check of the packed-weight kernel (mlx_parallm_provider/models/kernels/qmatmul.c),
 * built with it for whatever target the compiler aims at and run there (natively, or under an
 * emulator for arm64): each entry point against a float64 reference over the same packed weights,
 * and a row's outputs against the same row multiplied alone. Prints one line a case and "ALL OK"
 * at the end, or "FAIL" lines; exits 1 on a failure.
 *
 *   cc -O2 -fno-signed-zeros -fno-trapping-math qmatmul_check.c <kernels>/qmatmul.c -I<kernels> -lm -lpthread
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int qmatmul(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *biases, int N, int bits,
            int group, float *y, int threads);
int qmatmul_int8(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *biases, int N, int bits,
                 int group, float *y, int threads);
int qgemm_panels(const float *x, int M, int K, const uint8_t *w, const float *scales, const float *biases, int N, int bits,
                 int group, float *y, int threads);

typedef int (*kernel_fn)(const float *, int, int, const uint8_t *, const float *, const float *, int, int, int, float *, int);

static uint64_t state = 88172645463325252ull;
static double uniform(void) { /* xorshift64: the same inputs on every target */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (double)(state >> 11) / 9007199254740992.0;
}

static int failures = 0;

/* One shape through one kernel: relative error against float64, and each row alone. */
static void check(const char *name, kernel_fn kernel, int M, int K, int N, int bits, int group, int threads, double tol) {
    int G = K / group;
    size_t row_bytes = (size_t)K * bits / 8;
    uint8_t *w = malloc((size_t)N * row_bytes);
    float *scales = malloc(sizeof(float) * (size_t)N * G), *biases = malloc(sizeof(float) * (size_t)N * G);
    float *x = malloc(sizeof(float) * (size_t)M * K), *y = malloc(sizeof(float) * (size_t)M * N), *one = malloc(sizeof(float) * N);
    for (size_t i = 0; i < (size_t)N * row_bytes; i++) w[i] = (uint8_t)(uniform() * 256);
    for (size_t i = 0; i < (size_t)N * G; i++) scales[i] = (float)(0.001 + 0.02 * uniform()), biases[i] = (float)(-0.1 * uniform());
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = (float)(2 * uniform() - 1);
    if (kernel(x, M, K, w, scales, biases, N, bits, group, y, threads) != 0) {
        printf("FAIL %s M=%d K=%d N=%d bits=%d group=%d: refused\n", name, M, K, N, bits, group);
        failures++;
        return;
    }
    double worst = 0, largest = 1e-30;
    int apart = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K; k++) {
                const uint8_t *wr = w + (size_t)n * row_bytes;
                int q = bits == 4 ? (wr[k / 2] >> (4 * (k & 1))) & 15 : wr[k];
                ref += (double)x[(size_t)m * K + k] * ((double)q * scales[(size_t)n * G + k / group] + biases[(size_t)n * G + k / group]);
            }
            worst = fmax(worst, fabs(ref - y[(size_t)m * N + n]));
            largest = fmax(largest, fabs(ref));
        }
    for (int m = 0; m < M && M > 1; m++) { /* each row alone gives the same bits */
        kernel(x + (size_t)m * K, 1, K, w, scales, biases, N, bits, group, one, threads);
        if (kernel == qmatmul)  /* (one row takes the row kernel too: the same path) */
            apart += memcmp(one, y + (size_t)m * N, sizeof(float) * N) != 0;
    }
    double rel = worst / largest;
    int bad = !(rel <= tol) || apart;
    printf("%s %s M=%d K=%d N=%d bits=%d group=%d threads=%d rel_err=%.3g rows_apart=%d\n", bad ? "FAIL" : "ok", name, M, K, N,
           bits, group, threads, rel, apart);
    failures += bad;
    free(w), free(scales), free(biases), free(x), free(y), free(one);
}

/* Panels and int8: a row among others equals that row among other rows (the batch's company
 * never changes a row's bits): rows 0..M-1 against rows 0..M-1 of a call with M + 5 rows. */
static void company(const char *name, kernel_fn kernel, int M, int K, int N, int bits, int group) {
    int G = K / group, M2 = M + 5;
    size_t row_bytes = (size_t)K * bits / 8;
    uint8_t *w = malloc((size_t)N * row_bytes);
    float *scales = malloc(sizeof(float) * (size_t)N * G), *biases = malloc(sizeof(float) * (size_t)N * G);
    float *x = malloc(sizeof(float) * (size_t)M2 * K), *a = malloc(sizeof(float) * (size_t)M * N), *b = malloc(sizeof(float) * (size_t)M2 * N);
    for (size_t i = 0; i < (size_t)N * row_bytes; i++) w[i] = (uint8_t)(uniform() * 256);
    for (size_t i = 0; i < (size_t)N * G; i++) scales[i] = (float)(0.001 + 0.02 * uniform()), biases[i] = (float)(-0.1 * uniform());
    for (size_t i = 0; i < (size_t)M2 * K; i++) x[i] = (float)(2 * uniform() - 1);
    kernel(x, M, K, w, scales, biases, N, bits, group, a, 2);
    kernel(x, M2, K, w, scales, biases, N, bits, group, b, 2);
    int same = memcmp(a, b, sizeof(float) * (size_t)M * N) == 0;
    printf("%s %s company M=%d+5 K=%d N=%d bits=%d group=%d\n", same ? "ok" : "FAIL", name, M, K, N, bits, group);
    failures += !same;
    free(w), free(scales), free(biases), free(x), free(a), free(b);
}

int main(void) {
    static const int rows[] = {1, 2, 3, 5, 8, 13, 16, 37, 64};
    static const int shapes[][3] = {{256, 72, 32}, {576, 40, 64}, {1536, 24, 128}};  /* K, N, group */
    for (int bits = 4; bits <= 8; bits += 4)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
                int K = shapes[s][0], N = shapes[s][1], group = shapes[s][2], M = rows[r];
                check("qmatmul", qmatmul, M, K, N, bits, group, r % 2 + 1, 1e-5);
                check("panels", qgemm_panels, M, K, N, bits, group, r % 2 + 1, 1e-5);
                check("int8", qmatmul_int8, M, K, N, bits, group, r % 2 + 1, 2e-2);
            }
    for (int bits = 4; bits <= 8; bits += 4) {
        company("panels", qgemm_panels, 11, 576, 40, bits, 64);
        company("int8", qmatmul_int8, 11, 576, 40, bits, 64);
    }
    printf(failures ? "FAILURES %d\n" : "ALL OK\n", failures);
    return failures != 0;
}
