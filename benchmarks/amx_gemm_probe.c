/* AMX (Intel Advanced Matrix Extensions) bf16 products against tailserve's AVX2 kernel: a
 * probe for whether the CPU decode path should use the tile unit (docs/benchmarks.md,
 * 2026-12-04). Not used by the engine. Build and run (needs amx_bf16 and Linux >= 5.16):
 *
 *   gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -c src/tailserve/kernels/cpu/gemv_avx2.c -o /tmp/avx2.o
 *   gcc -O3 -mavx512f -mavx512bw -mavx512bf16 -mamx-tile -mamx-bf16 -fopenmp \
 *       benchmarks/amx_gemm_probe.c /tmp/avx2.o -lm -o /tmp/amx_probe && /tmp/amx_probe
 *
 * y[m, n] = sum_k bf16(x[m, k]) * w[n, k] with TDPBF16PS: weights repacked per 16 output rows
 * and 32 inputs into the tile unit's pair-interleaved layout (groups of three 16-row blocks,
 * chunk-major, so each thread reads one linear stream), activations rounded to bf16, three
 * accumulator tiles in flight. Each output row is computed alone in the tile (row m of C
 * depends only on row m of A), so results do not depend on the batch; but the tile unit's
 * rounding is its own (no order of fp32 FMAs or VDPBF16PS reproduced it bit for bit in
 * 3,200 outputs), so one engine cannot mix it with an AVX path by row count without losing
 * batch invariance and speculation's greedy identity. The working set is 24 MB, about one
 * model's weights, so the figures are of the weights streamed from the last-level cache. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

void tailserve_gemm_bf16w(const float* x, const uint16_t* w, const float* scale, float* y, long M, long N, long K,
                          int threads);

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

static long group_offset(long nb, long NB, long KC, long kc) {  /* in 512-element tiles */
    long g = nb / 3, b = nb % 3, gsz = g * 3 + 3 <= NB ? 3 : NB - g * 3;
    return g * 3 * KC + kc * gsz + b;
}

static void pack(const uint16_t* w, uint16_t* p, long N, long K) {
    long NB = (N + 15) / 16, KC = (K + 31) / 32;
    memset(p, 0, NB * KC * 512 * 2);
    for (long n = 0; n < N; n++)
        for (long k = 0; k < K; k++)
            p[group_offset(n / 16, NB, KC, k / 32) * 512 + (k % 32 / 2) * 32 + n % 16 * 2 + (k & 1)] = w[n * K + k];
}

static __thread long configured_rows = -1;

static void gemm_amx(const float* x, const uint16_t* p, float* y, long M, long N, long K, int threads, uint16_t* xb) {
    long KC = (K + 31) / 32, Kp = KC * 32, NB = (N + 15) / 16;
    memset(xb, 0, M * Kp * 2);
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i*)(xb + m * Kp + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + k)));
    _Pragma("omp parallel num_threads(threads)")
    {
        if (configured_rows != M) {
            tilecfg c;
            memset(&c, 0, sizeof c);
            c.palette = 1;
            for (int t = 0; t < 4; t++) { c.rows[t] = (uint8_t)M; c.colsb[t] = 64; }   /* C0-C2, A */
            for (int t = 4; t < 7; t++) { c.rows[t] = 16; c.colsb[t] = 64; }           /* B4-B6 */
            _tile_loadconfig(&c);
            configured_rows = M;
        }
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long NG = (NB + 2) / 3, per = (NG + nt - 1) / nt, lo = t * per * 3, hi = lo + per * 3 < NB ? lo + per * 3 : NB;
        float out[256];
        for (long nb = lo; nb < hi; nb += 3) {
            long gsz = nb + 3 <= NB ? 3 : NB - nb;
            const uint16_t* base = p + group_offset(nb, NB, KC, 0) * 512;
            _tile_zero(0); _tile_zero(1); _tile_zero(2);
            for (long kc = 0; kc < KC; kc++) {
                const uint16_t* q = base + kc * gsz * 512;
                _tile_loadd(3, xb + kc * 32, Kp * 2);
                _tile_loadd(4, q, 64);
                _tile_dpbf16ps(0, 3, 4);
                if (gsz > 1) { _tile_loadd(5, q + 512, 64); _tile_dpbf16ps(1, 3, 5); }
                if (gsz > 2) { _tile_loadd(6, q + 1024, 64); _tile_dpbf16ps(2, 3, 6); }
            }
            for (long b = 0; b < gsz; b++) {
                if (b == 0) _tile_stored(0, out, 64); else if (b == 1) _tile_stored(1, out, 64); else _tile_stored(2, out, 64);
                long n0 = (nb + b) * 16, nn = N - n0 < 16 ? N - n0 : 16;
                for (long m = 0; m < M; m++) memcpy(y + m * N + n0, out + m * 16, nn * 4);
            }
        }
    }
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        fprintf(stderr, "the kernel refused the AMX tile state\n");
        return 2;
    }
    const long shapes[][2] = {{2048, 384}, {384, 1024}, {4096, 384}, {2816, 512}, {32000, 512}};
    const int rows[] = {1, 2, 4, 8, 12, 16};
    printf("%6s %5s %3s %10s %10s %8s %9s\n", "N", "K", "M", "avx2 us", "amx us", "amx/avx2", "max rel");
    for (int s = 0; s < 5; s++) {
        long N = shapes[s][0], K = shapes[s][1], copies = (24L << 20) / (N * K * 2) + 1;
        long packed = (N + 15) / 16 * 16 * ((K + 31) / 32 * 32);
        uint16_t *w = malloc(copies * N * K * 2), *p = malloc(copies * packed * 2), *xb = malloc(16 * (K + 32) * 2);
        float *x = malloc(16 * K * 4), *y = malloc(16 * N * 4), *y2 = malloc(16 * N * 4);
        srand(1);
        for (long i = 0; i < copies * N * K; i++) {
            float f = rand() / (float)RAND_MAX - 0.5f;
            uint32_t u;
            memcpy(&u, &f, 4);
            w[i] = (uint16_t)(u >> 16);
        }
        for (long c = 0; c < copies; c++) pack(w + c * N * K, p + c * packed, N, K);
        for (long i = 0; i < 16 * K; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
        for (int r = 0; r < 6; r++) {
            long M = rows[r];
            double best[2] = {1e9, 1e9};
            for (int rep = 0; rep < 5; rep++)
                for (int v = 0; v < 2; v++) {
                    double t = now();
                    for (long c = 0; c < copies * 4; c++) {
                        if (v == 0) tailserve_gemm_bf16w(x, w + c % copies * N * K, NULL, y, M, N, K, 2);
                        else gemm_amx(x, p + c % copies * packed, y2, M, N, K, 2, xb);
                    }
                    double dt = (now() - t) / (copies * 4);
                    if (dt < best[v]) best[v] = dt;
                }
            double err = 0, mag = 0;
            for (long i = 0; i < M * N; i++) { err = fmax(err, fabs(y[i] - y2[i])); mag = fmax(mag, fabs(y[i])); }
            printf("%6ld %5ld %3ld %10.1f %10.1f %7.2fx %9.1e\n", N, K, M, best[0] * 1e6, best[1] * 1e6, best[0] / best[1],
                   err / mag);
        }
        free(w); free(p); free(xb); free(x); free(y); free(y2);
    }
    return 0;
}
