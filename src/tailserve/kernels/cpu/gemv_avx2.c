/* Weight-compact matrix products for CPU decode (tailserve/model/cpu_kernels/__init__.py).
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x, y float32; w bf16, fp16 or int8
 *
 * Batch-1 and small-batch decode read every weight once per step, so their speed is weight
 * bytes over memory bandwidth. These kernels keep the weights compact in memory (bf16: half of
 * float32; int8 + one float scale per row: a quarter) and widen them to float32 in registers
 * (bf16 -> f32 is a 16-bit shift, fp16 -> f32 one F16C instruction; both exact), so the arithmetic is float32 FMA on AVX2: what
 * llama.cpp does on CPUs without native bf16.
 *
 * Layout of the work: each thread streams one contiguous range of weight rows, row after row,
 * prefetching a few KB ahead (one linear stream per core reads DRAM faster here than several
 * interleaved rows: measured 19 against 10-12 GB/s). Weight rows go three at a time against
 * up to four activation rows (see DEFINE_GEMM), the rows staying in L1 after the first block. OpenMP is the same libgomp PyTorch loaded. K must be a multiple of 8 (the
 * caller checks); N and M are arbitrary.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* The largest of a vector's 8 lanes. */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline __m256 widen_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 widen_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

static inline __m256 widen_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* Elements ahead of the current one that each thread prefetches, past the end of its chunk
 * too (4-8 KB: measured best here, 10 -> 19 GB/s for a bf16 weight streamed from DRAM). */
#define PREFETCH_AHEAD 2048

/* Work is claimed in chunks from a shared counter, not split in equal halves up front: on a
 * small machine a thread of ours often loses its core for a while (a load generator, the
 * server's own HTTP work, a neighbour), and with a static split every other thread then waits
 * for its share at the end of the region; claimed, the threads still running take it over.
 * About 8 chunks a thread, each a multiple of `unit` (so the tiles do not depend on the split). */
static inline long claim_chunk(long P, long unit, int threads) {
    long target = (long)threads * 8;
    long chunk = (P + target - 1) / target;
    chunk = (chunk + unit - 1) / unit * unit;
    return chunk < unit ? unit : chunk;
}

/* Every output is one accumulator summed over K in order, 8 lanes at a time, then reduced:
 * the same arithmetic whichever block it falls in, so a row's result does not depend on the
 * batch it shares (batch-invariant logits). Blocks: 3 weight rows x R activation rows, R = 4
 * while four are left and then the 1-3 left over in one more pass (12 accumulators at R = 4:
 * each widened weight vector feeds R FMAs, each activation vector 3). Widening the compact
 * weights costs as much as the FMAs it feeds at R = 1, so the rows left over share one pass
 * rather than one each: a verification step of 3 rows (2 drafts) costs ~1.2x a decode row, not
 * 2.1-2.5x as it did. A weight row left over takes 1 x R the same way. */
#define DEFINE_GEMM(NAME, WT, WIDEN)                                                                   \
static inline __attribute__((always_inline)) void NAME##_3xr(const WT* r0, const float* x, float* y,    \
        const float* s, long N, long K, const int R, int prefetch, const WT* end) {                  \
    const WT *r1 = r0 + K, *r2 = r1 + K;                                                             \
    __m256 c[3][4];                                                                                  \
    for (int j = 0; j < 4; j++) c[0][j] = c[1][j] = c[2][j] = _mm256_setzero_ps();                   \
    for (long k = 0; k < K; k += 8) {                                                                \
        if (prefetch && r0 + 3 * k + PREFETCH_AHEAD < end)                                           \
            _mm_prefetch((const char*)(r0 + 3 * k + PREFETCH_AHEAD), _MM_HINT_T0);                   \
        __m256 w0 = WIDEN(r0 + k), w1 = WIDEN(r1 + k), w2 = WIDEN(r2 + k);                           \
        for (int j = 0; j < R; j++) {                                                                \
            __m256 xv = _mm256_loadu_ps(x + j * K + k);                                              \
            c[0][j] = _mm256_fmadd_ps(w0, xv, c[0][j]); c[1][j] = _mm256_fmadd_ps(w1, xv, c[1][j]);  \
            c[2][j] = _mm256_fmadd_ps(w2, xv, c[2][j]);                                              \
        }                                                                                            \
    }                                                                                                \
    for (int j = 0; j < R; j++) {                                                                    \
        float* o = y + j * N;                                                                        \
        o[0] = hsum8(c[0][j]) * s[0]; o[1] = hsum8(c[1][j]) * s[1]; o[2] = hsum8(c[2][j]) * s[2];    \
    }                                                                                                \
}                                                                                                    \
static inline __attribute__((always_inline)) void NAME##_1xr(const WT* r, const float* x, float* y,     \
        float s, long N, long K, const int R, int prefetch, const WT* end) {                         \
    __m256 a[4];                                                                                     \
    for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_ps();                                          \
    for (long k = 0; k < K; k += 8) {                                                                \
        if (prefetch && r + k + PREFETCH_AHEAD < end)                                                \
            _mm_prefetch((const char*)(r + k + PREFETCH_AHEAD), _MM_HINT_T0);                        \
        __m256 w0 = WIDEN(r + k);                                                                    \
        for (int j = 0; j < R; j++) a[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * K + k), a[j]); \
    }                                                                                                \
    for (int j = 0; j < R; j++) y[j * N] = hsum8(a[j]) * s;                                          \
}                                                                                                    \
void NAME(const float* x, const WT* w, const float* scale, float* y, long M, long N, long K, int threads) { \
    long chunk = claim_chunk(N, 3, threads), next = 0;                                               \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    {                                                                                                \
        const WT* end = w + N * K;                                                                   \
        for (;;) {                                                                                   \
        long lo = __atomic_fetch_add(&next, chunk, __ATOMIC_RELAXED);                                \
        if (lo >= N) break;                                                                          \
        long hi = lo + chunk < N ? lo + chunk : N;                                                   \
        long n = lo;                                                                                 \
        for (; n + 3 <= hi; n += 3) {                                                                \
            const WT* r0 = w + n * K;                                                                \
            float s[3] = {scale ? scale[n] : 1.0f, scale ? scale[n + 1] : 1.0f, scale ? scale[n + 2] : 1.0f}; \
            for (long m = 0; m < M; m += 4) {                                                        \
                const float* xm = x + m * K;                                                         \
                float* ym = y + m * N + n;                                                           \
                int pf = m == 0;                                                                     \
                switch (M - m < 4 ? (int)(M - m) : 4) {                                              \
                case 4: NAME##_3xr(r0, xm, ym, s, N, K, 4, pf, end); break;                          \
                case 3: NAME##_3xr(r0, xm, ym, s, N, K, 3, pf, end); break;                          \
                case 2: NAME##_3xr(r0, xm, ym, s, N, K, 2, pf, end); break;                          \
                default: NAME##_3xr(r0, xm, ym, s, N, K, 1, pf, end); break;                         \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (; n < hi; n++) {                                                                        \
            const WT* r = w + n * K;                                                                 \
            float s = scale ? scale[n] : 1.0f;                                                       \
            for (long m = 0; m < M; m += 4) {                                                        \
                const float* xm = x + m * K;                                                         \
                float* ym = y + m * N + n;                                                           \
                int pf = m == 0;                                                                     \
                switch (M - m < 4 ? (int)(M - m) : 4) {                                              \
                case 4: NAME##_1xr(r, xm, ym, s, N, K, 4, pf, end); break;                           \
                case 3: NAME##_1xr(r, xm, ym, s, N, K, 3, pf, end); break;                           \
                case 2: NAME##_1xr(r, xm, ym, s, N, K, 2, pf, end); break;                           \
                default: NAME##_1xr(r, xm, ym, s, N, K, 1, pf, end); break;                          \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        }                                                                                            \
    }                                                                                                \
}


DEFINE_GEMM(tailserve_gemm_bf16w, uint16_t, widen_bf16)
DEFINE_GEMM(tailserve_gemm_f16w, uint16_t, widen_f16)
DEFINE_GEMM(tailserve_gemm_i8w, int8_t, widen_i8)

/* -- bf16 weights packed in column panels: an outer-product kernel ----------------------------
 *
 * The row-major kernels above are dot products: every 8 weights are widened (two instructions
 * that share the FMA ports) and feed at most 4 FMAs, which holds a 16-row product at 65-80% of
 * an AVX2 core's FMA peak (measured on Zen 3, docs/benchmarks.md). Packed, the weights are
 * re-laid once at load (kernels/cpu ``pack_panels``) in panels of 16 output columns, k-major: for each k one 256-bit word
 * holds the 16 bf16 weights of that panel, column j in the low half of 32-bit lane j and
 * column 8 + j in the high half. One load, one shift (low halves) and one AND (high halves)
 * give two float32 vectors that feed 2R FMAs against R broadcast activations: 6 x 16 tiles
 * run at ~90-95% of the peak, 1.25-1.45x the dot-product kernel at 16 rows.
 *
 * Arithmetic: every output is one float32 accumulator, x[m, 0] * w[n, 0] + ... in k order,
 * whichever tile shape computes it, so a row's result does not depend on the batch it shares
 * (batch-invariant logits; verification rows equal the decode rows). Batch 1 reads several
 * panels at once (1 x 4 panels: 8 independent accumulators) to hide the FMA latency. */
#define PANEL_PREFETCH 1024  /* 32-bit words (4 KB) ahead in a panel's stream */

/* R activation rows x NP panels, 2 * R * NP accumulators (at most 12 of the 16 registers). */
#define DEFINE_PANEL_TILE(R, NP)                                                                        \
static inline __attribute__((always_inline)) void panel_tile_##R##x##NP(const float* x, const uint32_t* pan, \
        float* y, long K, long ldy, int pf, const uint32_t* end) {                                     \
    __m256 c[R][2 * NP];                                                                             \
    for (int i = 0; i < R; i++) for (int j = 0; j < 2 * NP; j++) c[i][j] = _mm256_setzero_ps();      \
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);                                          \
    for (long k = 0; k < K; k++) {                                                                   \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                       \
            const uint32_t* src = pan + q * K * 8 + k * 8;                                           \
            if (pf && (k & 1) == 0 && src + PANEL_PREFETCH < end)                                    \
                _mm_prefetch((const char*)(src + PANEL_PREFETCH), _MM_HINT_T0);                      \
            __m256i v = _mm256_loadu_si256((const __m256i*)src);                                     \
            __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                               \
            __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                    \
                __m256 a = _mm256_broadcast_ss(x + i * K + k);                                       \
                c[i][2 * q] = _mm256_fmadd_ps(a, b0, c[i][2 * q]);                                   \
                c[i][2 * q + 1] = _mm256_fmadd_ps(a, b1, c[i][2 * q + 1]);                           \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int i = 0; i < R; i++)                                                                      \
        for (int j = 0; j < 2 * NP; j++) _mm256_storeu_ps(y + i * ldy + j * 8, c[i][j]);            \
}
DEFINE_PANEL_TILE(1, 1) DEFINE_PANEL_TILE(2, 1) DEFINE_PANEL_TILE(3, 1) DEFINE_PANEL_TILE(4, 1)
DEFINE_PANEL_TILE(5, 1) DEFINE_PANEL_TILE(6, 1) DEFINE_PANEL_TILE(1, 4) DEFINE_PANEL_TILE(2, 2)

/* A broadcast the compiler may not hoist: with 3 rows x 2 panels, GCC keeps the three
 * broadcasts live across both panels and spills an accumulator (a store-load chain per k that
 * halves the speed); reloading them per panel costs a load each and keeps 16 registers. */
static inline __attribute__((always_inline)) __m256 broadcast_reload(const float* p) {
    __m256 a;
    __asm__ volatile("vbroadcastss %1, %0" : "=x"(a) : "m"(*p));
    return a;
}

static inline __attribute__((always_inline)) void panel_tile_3x2(const float* x, const uint32_t* pan, float* y,
        long K, long ldy, int pf, const uint32_t* end) {
    __m256 c[3][4];
    for (int i = 0; i < 3; i++) for (int j = 0; j < 4; j++) c[i][j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k++) {
        for (int q = 0; q < 2; q++) {
            const uint32_t* src = pan + q * K * 8 + k * 8;
            if (pf && (k & 1) == 0 && src + PANEL_PREFETCH < end)
                _mm_prefetch((const char*)(src + PANEL_PREFETCH), _MM_HINT_T0);
            __m256i v = _mm256_loadu_si256((const __m256i*)src);
            __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16));
            for (int i = 0; i < 3; i++) {
                __m256 a = broadcast_reload(x + i * K + k);
                c[i][2 * q] = _mm256_fmadd_ps(a, b0, c[i][2 * q]);
                c[i][2 * q + 1] = _mm256_fmadd_ps(a, b1, c[i][2 * q + 1]);
            }
        }
    }
    for (int i = 0; i < 3; i++) for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + i * ldy + j * 8, c[i][j]);
}

static void panel_tile(int R, int NP, const float* x, const uint32_t* pan, float* y, long K, long ldy, int pf,
                       const uint32_t* end) {
    if (NP == 4) { panel_tile_1x4(x, pan, y, K, ldy, pf, end); return; }
    if (NP == 2) {
        if (R == 2) panel_tile_2x2(x, pan, y, K, ldy, pf, end);
        else panel_tile_3x2(x, pan, y, K, ldy, pf, end);
        return;
    }
    switch (R) {
    case 6: panel_tile_6x1(x, pan, y, K, ldy, pf, end); return;
    case 5: panel_tile_5x1(x, pan, y, K, ldy, pf, end); return;
    case 4: panel_tile_4x1(x, pan, y, K, ldy, pf, end); return;
    case 3: panel_tile_3x1(x, pan, y, K, ldy, pf, end); return;
    case 2: panel_tile_2x1(x, pan, y, K, ldy, pf, end); return;
    default: panel_tile_1x1(x, pan, y, K, ldy, pf, end); return;
    }
}

/* The same tiles in AVX-512 (a CPU with it has two 512-bit FMA units: ~1.9x the AVX2 FMA
 * rate measured on a Xeon core). A panel's 16 columns at k widen into one register: the eight
 * 32-bit words zero-extended by 16-bit halves give the lanes in the order c0 c8 c1 c9 .. c7 c15,
 * shifted into float32, and each tile's accumulators go back to column order once at the store.
 * Every output is still one float32 accumulator summed over k in order with the same FMAs, so
 * the results are bitwise those of the AVX2 tiles (tested), and R rows x 4 panels keep up to
 * 24 accumulators in the 32 registers. */
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define DEFINE_PANEL_TILE512(R, NP)                                                                     \
static inline TS_AVX512 __attribute__((always_inline)) void panel512_##R##x##NP(const float* x,         \
        const uint32_t* pan, float* y, long K, long ldy, int pf, const uint32_t* end) {                 \
    __m512 c[R][NP];                                                                                 \
    for (int i = 0; i < R; i++) for (int j = 0; j < NP; j++) c[i][j] = _mm512_setzero_ps();          \
    for (long k = 0; k < K; k++) {                                                                   \
        __m512 b[NP];                                                                                \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                       \
            const uint32_t* src = pan + q * K * 8 + k * 8;                                           \
            if (pf && (k & 1) == 0 && src + PANEL_PREFETCH < end)                                    \
                _mm_prefetch((const char*)(src + PANEL_PREFETCH), _MM_HINT_T0);                      \
            __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)src));              \
            b[q] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                    \
        }                                                                                            \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                        \
            __m512 a = _mm512_set1_ps(x[i * K + k]);                                                 \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) c[i][q] = _mm512_fmadd_ps(a, b[q], c[i][q]); \
        }                                                                                            \
    }                                                                                                \
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);   \
    for (int i = 0; i < R; i++)                                                                      \
        for (int q = 0; q < NP; q++) _mm512_storeu_ps(y + i * ldy + q * 16, _mm512_permutexvar_ps(order, c[i][q])); \
}
DEFINE_PANEL_TILE512(3, 1) DEFINE_PANEL_TILE512(4, 1)
DEFINE_PANEL_TILE512(5, 1) DEFINE_PANEL_TILE512(6, 1)
DEFINE_PANEL_TILE512(3, 4) DEFINE_PANEL_TILE512(4, 4) DEFINE_PANEL_TILE512(5, 4) DEFINE_PANEL_TILE512(6, 4)

static TS_AVX512 void panel_tile512(int R, int NP, const float* x, const uint32_t* pan, float* y, long K, long ldy,
                                    int pf, const uint32_t* end) {
    if (NP == 4) {
        switch (R) {
        case 6: panel512_6x4(x, pan, y, K, ldy, pf, end); return;
        case 5: panel512_5x4(x, pan, y, K, ldy, pf, end); return;
        case 4: panel512_4x4(x, pan, y, K, ldy, pf, end); return;
        default: panel512_3x4(x, pan, y, K, ldy, pf, end); return;
        }
    }
    switch (R) {
    case 6: panel512_6x1(x, pan, y, K, ldy, pf, end); return;
    case 5: panel512_5x1(x, pan, y, K, ldy, pf, end); return;
    case 4: panel512_4x1(x, pan, y, K, ldy, pf, end); return;
    default: panel512_3x1(x, pan, y, K, ldy, pf, end); return;
    }
}

/* Which tiles the panel products use: 1 AVX-512 (where the CPU has it), 0 AVX2; chosen once
 * when the library loads (tailserve_panel_isa), the same for every call after. */
static int panel_isa = -1;

/* -1 reads the choice (detecting the CPU the first time); 0 or 1 sets it (1 only where the CPU
 * has AVX-512 F/BW/VL/DQ). Returns the choice in force. */
int tailserve_panel_isa(int want) {
    int has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
              && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (want >= 0) panel_isa = want && has;
    else if (panel_isa < 0) panel_isa = has;
    return panel_isa;
}

/* The body of a panel product (y (M, N) = x (M, K) @ w^T, w in panels of 16 columns, STRIDE
 * elements of WT a panel's k): each thread takes contiguous ranges of panels (one linear
 * stream of weights) claimed from a shared counter, GROUP panels at a time; within them the
 * rows go as ceil(M / 6) tiles of up to 6 rows (the panel stays in L1/L2 across the tiles), a
 * panel cut by N through a scratch tile. TILE(R, np, x, pan, n0, y, ldy, pf, end) computes
 * one tile. A macro, not a function taking its tile by pointer: stamped per tile set, the
 * compiler keeps each loop specialised (through a pointer, 2-row int8 products ran 1.7-2x
 * slower). */
#define PANEL_GEMM_BODY(WT, STRIDE, GROUP, TILE)                                                          \
    long P = (N + 15) / 16;                                                                          \
    long tiles = (M + 5) / 6;                                                                        \
    long chunk = claim_chunk(P, GROUP, threads);                                                     \
    long next = 0;  /* the first panel no thread has claimed yet */                                  \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    {                                                                                                \
        const WT* end = wp + P * K * (STRIDE);                                                       \
        float tmp[6 * 16 * 4];                                                                       \
        for (;;) {                                                                                   \
        long lo = __atomic_fetch_add(&next, chunk, __ATOMIC_RELAXED);                                \
        if (lo >= P) break;                                                                          \
        long hi = lo + chunk < P ? lo + chunk : P;                                                   \
        for (long pp = lo; pp < hi;) {                                                               \
            int np = pp + (GROUP) <= hi ? (GROUP) : 1;                                               \
            const WT* pan = wp + pp * K * (STRIDE);                                                  \
            long n0 = pp * 16, width = 16 * np;                                                      \
            int full = n0 + width <= N;                                                              \
            long m = 0;                                                                              \
            for (long ti = 0; ti < tiles; ti++) {                                                    \
                int R = (int)(M / tiles + (ti < M % tiles));                                         \
                float* ym = full ? y + m * N + n0 : tmp;                                             \
                TILE(R, np, x + m * K, pan, n0, ym, full ? N : width, m == 0, end);                  \
                if (!full)                                                                           \
                    for (int i = 0; i < R; i++)                                                      \
                        for (long n = n0; n < N; n++) y[(m + i) * N + n] = tmp[i * width + n - n0];  \
                m += R;                                                                              \
            }                                                                                        \
            pp += np;                                                                                \
        }                                                                                            \
        }                                                                                            \
    }

#define BF16_TILE(R, NP, X, PAN, N0, Y, LDY, PF, END)                                                  \
    do {                                                                                             \
        if (wide) panel_tile512(R, NP, X, PAN, Y, K, LDY, PF, END);                                  \
        else panel_tile(R, NP, X, PAN, Y, K, LDY, PF, END);                                          \
    } while (0)

/* y (M, N) = x (M, K) @ w^T for w packed in panels (pack_panels): up to 3 rows as one tile over
 * 4, 2 or 2 panels at once, more rows as tiles of 4-6 rows over one panel (AVX2) or of 3-6
 * rows over 4 (AVX-512). */
void tailserve_gemm_bf16p(const float* x, const uint32_t* wp, float* y, long M, long N, long K, int threads) {
    int wide = M >= 3 && tailserve_panel_isa(-1);
    int group = wide ? 4 : M == 1 ? 4 : M <= 3 ? 2 : 1;
    PANEL_GEMM_BODY(uint32_t, 8, group, BF16_TILE)
}

/* -- int8 weights packed in column panels: the same outer-product kernel ---------------------
 *
 * Weight-only int8 (one float scale per output column) re-laid once at load (kernels/cpu
 * ``pack_panels_int8``) in panels of 16 output columns, k-major: for each k the 16 int8
 * weights of the panel, column j at byte j. Two sign-extensions and two conversions (AVX2;
 * one each with AVX-512) give the panel's 16 columns at k as float32, which feed 2R FMAs
 * against R broadcast activations, as the bf16 panels do, from half their bytes. The row-major
 * int8 kernel above is a dot product whose widening shares the FMA ports (at 16 rows the
 * built-in draft ran 1.2x slower through it than through bf16 panels, 2 Xeon cores).
 *
 * Arithmetic: every output is one float32 accumulator, x[m, 0] * w[n, 0] + ... in k order,
 * then times the column's scale, whichever tile shape (AVX2 or AVX-512) computes it: a row's
 * result does not depend on the batch it shares. */
#define I8_PANEL_PREFETCH 4096  /* bytes ahead in a panel's stream */

static inline __attribute__((always_inline)) __m256 widen8_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

#define DEFINE_I8_PANEL_TILE(R, NP)                                                                     \
static inline __attribute__((always_inline)) void i8panel_tile_##R##x##NP(const float* x, const int8_t* pan, \
        const float* sc, float* y, long K, long ldy, int pf, const int8_t* end) {                      \
    __m256 c[R][2 * NP];                                                                             \
    for (int i = 0; i < R; i++) for (int j = 0; j < 2 * NP; j++) c[i][j] = _mm256_setzero_ps();      \
    for (long k = 0; k < K; k++) {                                                                   \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                       \
            const int8_t* src = pan + q * K * 16 + k * 16;                                           \
            if (pf && (k & 3) == 0 && src + I8_PANEL_PREFETCH < end)                                 \
                _mm_prefetch((const char*)(src + I8_PANEL_PREFETCH), _MM_HINT_T0);                   \
            __m256 b0 = widen8_i8(src), b1 = widen8_i8(src + 8);                                     \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                    \
                __m256 a = _mm256_broadcast_ss(x + i * K + k);                                       \
                c[i][2 * q] = _mm256_fmadd_ps(a, b0, c[i][2 * q]);                                   \
                c[i][2 * q + 1] = _mm256_fmadd_ps(a, b1, c[i][2 * q + 1]);                           \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int i = 0; i < R; i++)                                                                      \
        for (int j = 0; j < 2 * NP; j++)                                                             \
            _mm256_storeu_ps(y + i * ldy + j * 8, _mm256_mul_ps(c[i][j], _mm256_loadu_ps(sc + j * 8))); \
}
DEFINE_I8_PANEL_TILE(1, 1) DEFINE_I8_PANEL_TILE(2, 1) DEFINE_I8_PANEL_TILE(3, 1) DEFINE_I8_PANEL_TILE(4, 1)
DEFINE_I8_PANEL_TILE(5, 1) DEFINE_I8_PANEL_TILE(6, 1) DEFINE_I8_PANEL_TILE(1, 4) DEFINE_I8_PANEL_TILE(2, 2)

static void i8panel_tile(int R, int NP, const float* x, const int8_t* pan, const float* sc, float* y, long K,
                         long ldy, int pf, const int8_t* end) {
    if (NP == 4) { i8panel_tile_1x4(x, pan, sc, y, K, ldy, pf, end); return; }
    if (NP == 2) { i8panel_tile_2x2(x, pan, sc, y, K, ldy, pf, end); return; }
    switch (R) {
    case 6: i8panel_tile_6x1(x, pan, sc, y, K, ldy, pf, end); return;
    case 5: i8panel_tile_5x1(x, pan, sc, y, K, ldy, pf, end); return;
    case 4: i8panel_tile_4x1(x, pan, sc, y, K, ldy, pf, end); return;
    case 3: i8panel_tile_3x1(x, pan, sc, y, K, ldy, pf, end); return;
    case 2: i8panel_tile_2x1(x, pan, sc, y, K, ldy, pf, end); return;
    default: i8panel_tile_1x1(x, pan, sc, y, K, ldy, pf, end); return;
    }
}

#define DEFINE_I8_PANEL_TILE512(R, NP)                                                                  \
static inline TS_AVX512 __attribute__((always_inline)) void i8panel512_##R##x##NP(const float* x,      \
        const int8_t* pan, const float* sc, float* y, long K, long ldy, int pf, const int8_t* end) {    \
    __m512 c[R][NP];                                                                                 \
    for (int i = 0; i < R; i++) for (int j = 0; j < NP; j++) c[i][j] = _mm512_setzero_ps();          \
    for (long k = 0; k < K; k++) {                                                                   \
        __m512 b[NP];                                                                                \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) {                                       \
            const int8_t* src = pan + q * K * 16 + k * 16;                                           \
            if (pf && (k & 3) == 0 && src + I8_PANEL_PREFETCH < end)                                 \
                _mm_prefetch((const char*)(src + I8_PANEL_PREFETCH), _MM_HINT_T0);                   \
            b[q] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)src)));   \
        }                                                                                            \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                        \
            __m512 a = _mm512_set1_ps(x[i * K + k]);                                                 \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++) c[i][q] = _mm512_fmadd_ps(a, b[q], c[i][q]); \
        }                                                                                            \
    }                                                                                                \
    for (int i = 0; i < R; i++)                                                                      \
        for (int q = 0; q < NP; q++)                                                                 \
            _mm512_storeu_ps(y + i * ldy + q * 16, _mm512_mul_ps(c[i][q], _mm512_loadu_ps(sc + q * 16))); \
}
DEFINE_I8_PANEL_TILE512(3, 1) DEFINE_I8_PANEL_TILE512(4, 1)
DEFINE_I8_PANEL_TILE512(5, 1) DEFINE_I8_PANEL_TILE512(6, 1)
DEFINE_I8_PANEL_TILE512(3, 4) DEFINE_I8_PANEL_TILE512(4, 4) DEFINE_I8_PANEL_TILE512(5, 4) DEFINE_I8_PANEL_TILE512(6, 4)

static TS_AVX512 void i8panel_tile512(int R, int NP, const float* x, const int8_t* pan, const float* sc, float* y,
                                      long K, long ldy, int pf, const int8_t* end) {
    if (NP == 4) {
        switch (R) {
        case 6: i8panel512_6x4(x, pan, sc, y, K, ldy, pf, end); return;
        case 5: i8panel512_5x4(x, pan, sc, y, K, ldy, pf, end); return;
        case 4: i8panel512_4x4(x, pan, sc, y, K, ldy, pf, end); return;
        default: i8panel512_3x4(x, pan, sc, y, K, ldy, pf, end); return;
        }
    }
    switch (R) {
    case 6: i8panel512_6x1(x, pan, sc, y, K, ldy, pf, end); return;
    case 5: i8panel512_5x1(x, pan, sc, y, K, ldy, pf, end); return;
    case 4: i8panel512_4x1(x, pan, sc, y, K, ldy, pf, end); return;
    default: i8panel512_3x1(x, pan, sc, y, K, ldy, pf, end); return;
    }
}

#define I8_TILE(R, NP, X, PAN, N0, Y, LDY, PF, END)                                                    \
    do {                                                                                             \
        if (wide) i8panel_tile512(R, NP, X, PAN, s + (N0), Y, K, LDY, PF, END);                      \
        else i8panel_tile(R, NP, X, PAN, s + (N0), Y, K, LDY, PF, END);                              \
    } while (0)

/* y (M, N) = (x (M, K) @ w^T) * s for w packed in int8 panels (pack_panels_int8) and s its
 * column scales, padded with zeros to whole panels: laid out as the bf16 panels' products, up
 * to 2 rows as one tile over 4 or 2 panels, more rows as tiles of 3-6 rows over 1 (AVX2) or 4
 * (AVX-512) panels. */
void tailserve_gemm_i8p(const float* x, const int8_t* wp, const float* s, float* y, long M, long N, long K,
                        int threads) {
    int wide = M >= 3 && tailserve_panel_isa(-1);
    int group = wide ? 4 : M == 1 ? 4 : M == 2 ? 2 : 1;
    PANEL_GEMM_BODY(int8_t, 16, group, I8_TILE)
}

/* -- int8 weights with int8 activations: a draft's products (W8A8, per-row scales) -----------
 *
 * Layout (kernels/cpu ``pack_panels_w8a8``): panels of 16 output columns; in a panel, for each
 * group of 4 consecutive k (K padded to a multiple of 4 with zeros) 64 bytes, column j's four
 * weights at bytes 4j..4j+3; after the last panel each padded column's weight sum (int32).
 * Each row of x is quantised on the way in: s = max|x| / 127, q = x * (127 / max|x|) rounded to
 * nearest even, in [-127, 127]. Then acc = sum_k q[m, k] w[n, k] in int32, exact whatever the
 * order or the instructions, and y = ((float)acc * s[m]) * scale[n]. With AVX-512 VNNI one
 * vpdpbusd takes 64 products (its x operand unsigned: q + 128, less 128 times the column's
 * sum); otherwise AVX2's vpsignb / vpmaddubsw / vpmaddwd take them (|q| <= 127: no int16
 * saturation). The same bits either way, each row's alone: a batch cannot change a row.
 *
 * Not the weight-only panels' numbers (the activations lose ~7 bits), which a draft's need not
 * be: the target verifies every draft. What it buys is the widening: the weight-only panels
 * spend two conversions per 8 weights beside the FMAs (the built-in draft's 4,096 x 256 head,
 * one row: ~50 us on one Xeon core); here a 64-byte load feeds one vpdpbusd. */
#define TS_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

static int w8a8_vnni = -1;  /* whether the AVX-512 VNNI tiles run: decided once, as tailserve_panel_isa */

static int w8a8_wide(void) {
    if (w8a8_vnni < 0) w8a8_vnni = __builtin_cpu_supports("avx512vnni");
    return w8a8_vnni && tailserve_panel_isa(-1);
}

/* Row m of x (M, K) -> xq[m * Kp ...] (zero past K) and its scale sx[m]. */
static void w8a8_quantize(const float* x, long M, long K, long Kp, int8_t* xq, float* sx) {
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (long m = 0; m < M; m++) {
        const float* r = x + m * K;
        int8_t* q = xq + m * Kp;
        __m256 mx = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(r + k), nosign), mx);
        float amax = hmax8(mx);
        for (; k < K; k++) { float a = fabsf(r[k]); if (a > amax) amax = a; }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        sx[m] = amax / 127.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        for (k = 0; k + 8 <= K; k += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), iv));  /* nearest even */
            v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256());
            int32_t a = _mm_cvtsi128_si32(_mm256_castsi256_si128(p));
            int32_t b = _mm_cvtsi128_si32(_mm256_extracti128_si256(p, 1));
            memcpy(q + k, &a, 4);
            memcpy(q + k + 4, &b, 4);
        }
        for (; k < K; k++) {
            long v = lrintf(r[k] * inv);
            q[k] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
        }
        for (; k < Kp; k++) q[k] = 0;
    }
}

/* R rows x 1 panel (AVX2): two accumulators of 8 int32 lanes a row (the panel's halves); y rows ldy apart. */
#define DEFINE_W8A8_TILE(R)                                                                             \
static inline __attribute__((always_inline)) void w8a8_tile_##R(const int8_t* xq, long Kp,            \
        const int8_t* pan, long G, const int32_t* cs, const float* sx, const float* sw, float* y,         \
        long ldy) {                                                                                      \
    (void)cs;                                                                                        \
    const __m256i ones = _mm256_set1_epi16(1);                                                       \
    __m256i a0[R], a1[R];                                                                            \
    for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_si256();                              \
    for (long g = 0; g < G; g++) {                                                                   \
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(pan + g * 64));                       \
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(pan + g * 64 + 32));                  \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                        \
            int32_t xv;                                                                              \
            memcpy(&xv, xq + i * Kp + 4 * g, 4);                                                     \
            const __m256i xs = _mm256_set1_epi32(xv), ax = _mm256_abs_epi8(xs);                      \
            a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xs)), ones)); \
            a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xs)), ones)); \
        }                                                                                            \
    }                                                                                                \
    const __m256 s0 = _mm256_loadu_ps(sw), s1 = _mm256_loadu_ps(sw + 8);                             \
    for (int i = 0; i < R; i++) {                                                                    \
        const __m256 xs = _mm256_set1_ps(sx[i]);                                                     \
        _mm256_storeu_ps(y + i * ldy, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0[i]), xs), s0)); \
        _mm256_storeu_ps(y + i * ldy + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1[i]), xs), s1)); \
    }                                                                                                \
}
DEFINE_W8A8_TILE(1) DEFINE_W8A8_TILE(2) DEFINE_W8A8_TILE(3) DEFINE_W8A8_TILE(4)

/* R rows x NP panels (AVX-512 VNNI): one zmm accumulator per row and panel, R * NP chains of
 * vpdpbusd (its latency is ~5 cycles: one row over one panel would wait on it). */
#define DEFINE_W8A8_TILE512(R, NP)                                                                      \
static inline TS_VNNI __attribute__((always_inline)) void w8a8_vnni_##R##x##NP(const int8_t* xq,      \
        long Kp, const int8_t* pan, long G, const int32_t* cs, const float* sx, const float* sw,          \
        float* y, long ldy) {                                                                            \
    const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080u);                                    \
    __m512i acc[R][NP];                                                                              \
    for (int i = 0; i < R; i++) for (int q = 0; q < NP; q++) acc[i][q] = _mm512_setzero_si512();     \
    for (long g = 0; g < G; g++) {                                                                   \
        __m512i w[NP];                                                                               \
        _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                         \
            w[q] = _mm512_loadu_si512((const void*)(pan + (q * G + g) * 64));                        \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                        \
            int32_t xv;                                                                              \
            memcpy(&xv, xq + i * Kp + 4 * g, 4);                                                     \
            const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(xv), flip);                         \
            _Pragma("GCC unroll 8") for (int q = 0; q < NP; q++)                                     \
                acc[i][q] = _mm512_dpbusd_epi32(acc[i][q], a, w[q]);                                 \
        }                                                                                            \
    }                                                                                                \
    for (int q = 0; q < NP; q++) {                                                                   \
        const __m512i c128 = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(cs + 16 * q)), 7);   \
        const __m512 s = _mm512_loadu_ps(sw + 16 * q);                                               \
        for (int i = 0; i < R; i++) {                                                                \
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][q], c128));                  \
            _mm512_storeu_ps(y + i * ldy + 16 * q, _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(sx[i])), s)); \
        }                                                                                            \
    }                                                                                                \
}
DEFINE_W8A8_TILE512(1, 1) DEFINE_W8A8_TILE512(2, 1) DEFINE_W8A8_TILE512(3, 1) DEFINE_W8A8_TILE512(4, 1)
DEFINE_W8A8_TILE512(1, 4) DEFINE_W8A8_TILE512(2, 4) DEFINE_W8A8_TILE512(3, 4) DEFINE_W8A8_TILE512(4, 4)

static TS_VNNI void w8a8_vnni_tile(int R, int NP, const int8_t* xq, long Kp, const int8_t* pan, long G,
                                   const int32_t* cs, const float* sx, const float* sw, float* y, long ldy) {
    if (NP == 4) {
        switch (R) {
        case 4: w8a8_vnni_4x4(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
        case 3: w8a8_vnni_3x4(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
        case 2: w8a8_vnni_2x4(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
        default: w8a8_vnni_1x4(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
        }
    }
    switch (R) {
    case 4: w8a8_vnni_4x1(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    case 3: w8a8_vnni_3x1(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    case 2: w8a8_vnni_2x1(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    default: w8a8_vnni_1x1(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    }
}

static void w8a8_avx2_tile(int R, const int8_t* xq, long Kp, const int8_t* pan, long G, const int32_t* cs,
                           const float* sx, const float* sw, float* y, long ldy) {
    switch (R) {
    case 4: w8a8_tile_4(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    case 3: w8a8_tile_3(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    case 2: w8a8_tile_2(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    default: w8a8_tile_1(xq, Kp, pan, G, cs, sx, sw, y, ldy); return;
    }
}

/* Products of fewer multiply-adds than this run on one thread: a parallel region costs more
 * than the built-in draft's layer products (65-330 thousand), at one row or a few. */
#define W8A8_PARALLEL_MACS (1L << 20)

/* y (M, N) = W8A8 product of x (M, K) float32 with w packed by pack_panels_w8a8 (its column
 * sums after the panels), s its padded column scales. */
void tailserve_gemm_w8a8p(const float* x, const int8_t* wp, const float* s, float* y, long M, long N, long K,
                          int threads) {
    const long Kp = (K + 3) & ~3L, G = Kp / 4, P = (N + 15) / 16;
    const int32_t* csum = (const int32_t*)(wp + P * Kp * 16);
    int8_t* xq = (int8_t*)malloc((size_t)(M * Kp) + sizeof(float) * (size_t)M);
    float* sx = (float*)(xq + M * Kp);
    w8a8_quantize(x, M, K, Kp, xq, sx);
    const int wide = w8a8_wide();
    const int nt = M * N * K >= W8A8_PARALLEL_MACS ? threads : 1;
    const int group = wide ? 4 : 1;  /* panels a tile takes at once */
    const long chunks = (P + group - 1) / group;
    _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")
    for (long c = 0; c < chunks; c++) {
        const long p0 = c * group;
        const int np = p0 + group <= P ? group : 1;
        for (long p = p0; p < p0 + group && p < P; p += np) {
            const int8_t* pan = wp + p * Kp * 16;
            const long n0 = p * 16, width = 16L * np;
            const int full = n0 + width <= N;
            float tmp[4 * 64];
            for (long m = 0; m < M; m += 4) {
                const int R = (int)(M - m < 4 ? M - m : 4);
                float* ym = full ? y + m * N + n0 : tmp;
                const long ldy = full ? N : width;
                if (wide) w8a8_vnni_tile(R, np, xq + m * Kp, Kp, pan, G, csum + n0, sx + m, s + n0, ym, ldy);
                else w8a8_avx2_tile(R, xq + m * Kp, Kp, pan, G, csum + n0, sx + m, s + n0, ym, ldy);
                if (!full)
                    for (int i = 0; i < R; i++)
                        for (long n = n0; n < N; n++) y[(m + i) * N + n] = tmp[i * width + n - n0];
            }
        }
    }
    free(xq);
}

/* -- the small per-layer operations of a decode step, fused --------------------------------
 * PyTorch spends 15-30 us per operation here whatever its size; a decode step of a small model
 * runs ~15 of them per layer. These do the same float32 arithmetic in one pass each. */

static inline float rms_scale(const float* h, long K, float eps) {
    __m256 acc = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_loadu_ps(h + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; k < K; k++) ss += h[k] * h[k];
    return 1.0f / sqrtf(ss / (float)K + eps);
}

/* y = h * rsqrt(mean(h^2) + eps) * w per row of h (M, K); with delta, h += delta first (the
 * residual stream, updated in place). */
void tailserve_add_rms_norm(float* h, const float* delta, const float* w, float* y, long M, long K, float eps) {
    for (long m = 0; m < M; m++) {
        float* hm = h + m * K;
        if (delta) {
            const float* dm = delta + m * K;
            long k = 0;
            for (; k + 8 <= K; k += 8)
                _mm256_storeu_ps(hm + k, _mm256_add_ps(_mm256_loadu_ps(hm + k), _mm256_loadu_ps(dm + k)));
            for (; k < K; k++) hm[k] += dm[k];
        }
        float r = rms_scale(hm, K, eps);
        __m256 rv = _mm256_set1_ps(r);
        float* ym = y + m * K;
        long k = 0;
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(ym + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hm + k), rv), _mm256_loadu_ps(w + k)));
        for (; k < K; k++) ym[k] = hm[k] * r * w[k];
    }
}

/* exp for AVX2 (Cephes' polynomial, as in the widely used avx_mathfun): ~1 ulp on [-88, 88]. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* out (M, I) = silu(gu[:, :I]) * gu[:, I:] for gu (M, 2I): the gated MLP's activation. */
void tailserve_silu_mul(const float* gu, float* out, long M, long I) {
    for (long m = 0; m < M; m++) {
        const float* g = gu + m * 2 * I;
        const float* u = g + I;
        float* o = out + m * I;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* -- decode attention over the paged KV cache -------------------------------------------------
 * One query per sequence: write the step's K/V into their slots, then per (sequence, KV head)
 * every query head that shares that KV head (GQA: heads h with h / (H / KVH) == kvh) scores
 * against each cached key of the sequence (block table order, each K and V row read once for
 * the whole group), softmax in float32, and the weighted sum of values. A window > 0 keeps
 * the last `window` positions. D must be a multiple of 8. Caches are (num_slots, KVH, D) with
 * slot = block * block_size + offset, in one of three formats (kv_fmt): 0 float32, 1 bf16,
 * 2 fp16. A 16-bit cache stores each K/V rounded to nearest-even (torch's .to() rounding) and
 * is widened to float32 in registers as it is read: half the bytes of every step's context
 * reads, which past a few tens of MB of KV are what a long-context decode step waits on. */
#define KV_F32 0
#define KV_BF16 1
#define KV_F16 2

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* n floats into the cache at element offset `off`, in its format. */
static void store_kv(void* cache, long off, const float* src, long n, int fmt) {
    if (fmt == KV_F32) { memcpy((float*)cache + off, src, n * sizeof(float)); return; }
    uint16_t* d = (uint16_t*)cache + off;
    long i = 0;
    if (fmt == KV_BF16) {
        for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
        return;
    }
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* 8 cache elements from element offset `idx`, widened to float32. Inlined where `fmt` is a
 * constant, so each format's loops carry no branch. */
static inline __attribute__((always_inline)) __m256 load_kv(const void* base, long idx, int fmt) {
    if (fmt == KV_F32) return _mm256_loadu_ps((const float*)base + idx);
    if (fmt == KV_BF16) return widen_bf16((const uint16_t*)base + idx);
    return widen_f16((const uint16_t*)base + idx);
}

static void attend_paged(const float* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
                         long bt_stride, const int32_t* seq_lens, float* out, long B, long H, long KVH, long D,
                         long block_size, float scale, long window, long max_ctx, int kv_fmt, int threads);

/* Prefetch the rows of one KV head in a cache block (rows of D elements, `stride` apart).
 * The blocks of a sequence sit wherever the block pool put them: where the next block in
 * table order is not the adjacent one, the hardware prefetcher starts over from a miss at
 * the jump, so the kernel asks for that block's rows one block ahead. Adjacent blocks are
 * left to the hardware. (b = 32, 300-token contexts, 2 AVX2 cores: a decode token cost 23%
 * more with every block shuffled than in order; a paged run of bench_kv_capacity.py at
 * 96 MiB reads ~21% of its block transitions as jumps, the contiguous reservation none.) */
static inline __attribute__((always_inline)) void prefetch_block(const void* base, long idx, long stride, long rows,
                                                                 long D, const int fmt) {
    const long es = fmt == KV_F32 ? 4 : 2;
    const char* p = (const char*)base + idx * es;
    for (long r = 0; r < rows; r++, p += stride * es)
        for (long by = 0; by < D * es; by += 64) _mm_prefetch(p + by, _MM_HINT_T0);
}

void tailserve_paged_decode_attention(const float* q, const float* k_new, const float* v_new, void* k_cache,
                                      void* v_cache, const int32_t* block_tables, long bt_stride,
                                      const int32_t* seq_lens, const int64_t* slots, float* out, long B, long H,
                                      long KVH, long D, long block_size, float scale, long window, long max_ctx,
                                      int kv_fmt, int threads) {
    for (long b = 0; b < B; b++) {
        store_kv(k_cache, slots[b] * KVH * D, k_new + b * KVH * D, KVH * D, kv_fmt);
        store_kv(v_cache, slots[b] * KVH * D, v_new + b * KVH * D, KVH * D, kv_fmt);
    }
    attend_paged(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, B, H, KVH, D, block_size, scale,
                 window, max_ctx, kv_fmt, threads);
}

/* The same, straight from the fused QKV projection's rows (qkv: B rows of (H + 2 KVH) * D at
 * qkv_stride): rotary embedding of q and k (rotate-half, cos/sin (B, D) per row, as
 * RotaryEmbedding.apply), the rotated k and v written into their slots, then attention. One
 * call where PyTorch ran a slice, a concatenation, two products and a sum per layer. */
void tailserve_rope_paged_decode_attention(const float* qkv, long qkv_stride, const float* cos, const float* sin,
                                           void* k_cache, void* v_cache, const int32_t* block_tables,
                                           long bt_stride, const int32_t* seq_lens, const int64_t* slots,
                                           float* out, long B, long H, long KVH, long D, long block_size,
                                           float scale, long window, long max_ctx, int kv_fmt, int threads) {
    float* q = (float*)malloc(sizeof(float) * (B * H * D + KVH * D));
    float* k_row = q + B * H * D;  /* one row's rotated keys, before they are stored */
    long half = D / 2;
    for (long b = 0; b < B; b++) {
        const float* row = qkv + b * qkv_stride;
        const float* c = cos + b * D;
        const float* sn = sin + b * D;
        for (long h = 0; h < H + KVH; h++) {
            const float* x = row + h * D;
            float* o = h < H ? q + (b * H + h) * D : k_row + (h - H) * D;
            for (long i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                o[i] = x1 * c[i] + (-x2) * sn[i];
                o[i + half] = x2 * c[i + half] + x1 * sn[i + half];
            }
        }
        store_kv(k_cache, slots[b] * KVH * D, k_row, KVH * D, kv_fmt);
        store_kv(v_cache, slots[b] * KVH * D, row + (H + KVH) * D, KVH * D, kv_fmt);
    }
    attend_paged(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, B, H, KVH, D, block_size, scale,
                 window, max_ctx, kv_fmt, threads);
    free(q);
}

/* out[head] += sum over positions pos0..stop-1 (rows off0.. of one cache block at element
 * offset vb, rows `stride` apart) of p[head][pos] * V[pos], for the G heads of one group. */
static inline __attribute__((always_inline)) void weigh_values(
        const void* v, long vb, long stride, const float* p, float* out, long H, long D, long max_ctx, long start,
        long b, long kvh, long G, long pos0, long off0, long stop, const int fmt) {
    for (long g = 0; g < G; g++) {
        const float* pg = p + g * (max_ctx + 8) - start;
        float* o = out + (b * H + kvh * G + g) * D;
        long d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {
            float* od = o + d0;
            __m256 a0 = _mm256_loadu_ps(od), a1 = _mm256_loadu_ps(od + 8);
            __m256 a2 = _mm256_loadu_ps(od + 16), a3 = _mm256_loadu_ps(od + 24);
            __m256 a4 = _mm256_loadu_ps(od + 32), a5 = _mm256_loadu_ps(od + 40);
            __m256 a6 = _mm256_loadu_ps(od + 48), a7 = _mm256_loadu_ps(od + 56);
            for (long pos = pos0, off = off0; pos < stop; pos++, off++) {
                long vv = vb + off * stride + d0;
                __m256 pj = _mm256_set1_ps(pg[pos]);
                a0 = _mm256_fmadd_ps(pj, load_kv(v, vv, fmt), a0);
                a1 = _mm256_fmadd_ps(pj, load_kv(v, vv + 8, fmt), a1);
                a2 = _mm256_fmadd_ps(pj, load_kv(v, vv + 16, fmt), a2);
                a3 = _mm256_fmadd_ps(pj, load_kv(v, vv + 24, fmt), a3);
                a4 = _mm256_fmadd_ps(pj, load_kv(v, vv + 32, fmt), a4);
                a5 = _mm256_fmadd_ps(pj, load_kv(v, vv + 40, fmt), a5);
                a6 = _mm256_fmadd_ps(pj, load_kv(v, vv + 48, fmt), a6);
                a7 = _mm256_fmadd_ps(pj, load_kv(v, vv + 56, fmt), a7);
            }
            _mm256_storeu_ps(od, a0); _mm256_storeu_ps(od + 8, a1);
            _mm256_storeu_ps(od + 16, a2); _mm256_storeu_ps(od + 24, a3);
            _mm256_storeu_ps(od + 32, a4); _mm256_storeu_ps(od + 40, a5);
            _mm256_storeu_ps(od + 48, a6); _mm256_storeu_ps(od + 56, a7);
        }
        for (; d0 < D; d0 += 8) {  /* a last slice narrower than 64 (D = 96, 80, ...) */
            __m256 a = _mm256_loadu_ps(o + d0);
            for (long pos = pos0, off = off0; pos < stop; pos++, off++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(pg[pos]), load_kv(v, vb + off * stride + d0, fmt), a);
            _mm256_storeu_ps(o + d0, a);
        }
    }
}

/* Softmax numerators in place over each head's n scores (rows pst apart), given the heads'
 * maxima in mx, which then hold the normalisers (1 / the sums). */
static inline __attribute__((always_inline)) void softmax_heads(float* p, long pst, long n, long G, float* mx) {
    for (long g = 0; g < G; g++) {
        float* pg = p + g * pst;
        __m256 mv = _mm256_set1_ps(mx[g]), sv = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(pg + j), mv));
            _mm256_storeu_ps(pg + j, e);
            sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum8(sv);
        for (; j < n; j++) { pg[j] = expf(pg[j] - mx[g]); sum += pg[j]; }
        mx[g] = 1.0f / sum;
    }
}

/* One (sequence, KV head) of attend_paged; p: G x (max_ctx + 8) scores, mx: G floats. */
static inline __attribute__((always_inline)) void attend_item(
        const float* q, const void* k_cache, const void* v_cache, const int32_t* block_tables, long bt_stride,
        const int32_t* seq_lens, float* out, long H, long KVH, long D, long block_size, float scale, long window,
        long max_ctx, long b, long kvh, float* p, float* mx, const int fmt) {
    long G = H / KVH, stride = KVH * D;
    long ctx = seq_lens[b];
    long start = window > 0 && ctx > window ? ctx - window : 0;
    long n = ctx - start;
    const float* qg = q + (b * H + kvh * G) * D;  /* the group's G query heads, contiguous */
    const int32_t* table = block_tables + b * bt_stride;
    for (long g = 0; g < G; g++) mx[g] = -INFINITY;
    /* Scores: walk the block table block by block (no division per position). */
    for (long j = start; j < ctx;) {
        long blk = j / block_size, off = j - blk * block_size;
        long stop = (blk + 1) * block_size < ctx ? (blk + 1) * block_size : ctx;
        long kb = ((long)table[blk] * block_size * KVH + kvh) * D;  /* element offset of the block's row */
        if (stop < ctx && table[blk + 1] != table[blk] + 1)
            prefetch_block(k_cache, ((long)table[blk + 1] * block_size * KVH + kvh) * D, stride, block_size, D, fmt);
        for (; j < stop; j++, off++) {
            long kv = kb + off * stride;
            __m256 kr[8];  /* the key row widened once for every head of the group (D <= 64) */
            int cached = fmt != KV_F32 && D <= 64;  /* float32 rows are read as they are */
            if (cached)
                for (long d = 0; d < D; d += 8) kr[d / 8] = load_kv(k_cache, kv + d, fmt);
            for (long g = 0; g < G; g++) {
                const float* qv = qg + g * D;
                __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
                long d = 0;
                if (cached) {
                    for (; d + 16 <= D; d += 16) {
                        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), kr[d / 8], c0);
                        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d + 8), kr[d / 8 + 1], c1);
                    }
                    if (d < D) c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), kr[d / 8], c0);
                } else {
                    for (; d + 16 <= D; d += 16) {
                        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), load_kv(k_cache, kv + d, fmt), c0);
                        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d + 8), load_kv(k_cache, kv + d + 8, fmt), c1);
                    }
                    if (d < D) c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), load_kv(k_cache, kv + d, fmt), c0);
                }
                float sc = hsum8(_mm256_add_ps(c0, c1)) * scale;
                p[g * (max_ctx + 8) + j - start] = sc;
                if (sc > mx[g]) mx[g] = sc;
            }
        }
    }
    softmax_heads(p, max_ctx + 8, n, G, mx);
    /* Weighted values, one cache block at a time: the block's value rows (block_size x D)
     * stay in L1 while every head of the group and every 64-wide slice of D takes its
     * sum over them in eight register accumulators, added to the output once per block.
     * (Per position through memory, or head by head over the whole context, this loop
     * ran 4x slower: a store-to-load chain, or value rows re-read from L3.) */
    for (long g = 0; g < G; g++) {
        float* o = out + (b * H + kvh * G + g) * D;
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
    }
    for (long pos0 = start; pos0 < ctx;) {
        long blk = pos0 / block_size, off0 = pos0 - blk * block_size;
        long stop = (blk + 1) * block_size < ctx ? (blk + 1) * block_size : ctx;
        long vb = ((long)table[blk] * block_size * KVH + kvh) * D;
        if (stop < ctx && table[blk + 1] != table[blk] + 1)
            prefetch_block(v_cache, ((long)table[blk + 1] * block_size * KVH + kvh) * D, stride, block_size, D, fmt);
        weigh_values(v_cache, vb, stride, p, out, H, D, max_ctx, start, b, kvh, G, pos0, off0, stop, fmt);
        pos0 = stop;
    }
    for (long g = 0; g < G; g++) {
        float* o = out + (b * H + kvh * G + g) * D;
        __m256 inv = _mm256_set1_ps(mx[g]);
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
    }
}

/* ---- A bf16 cache read as pairs ----
 *
 * A 32-bit lane of a bf16 row holds elements 2i (its low half) and 2i + 1 (its high half). As
 * float32 they are the lane shifted left by 16 bits and the lane with its low half cleared:
 * a load, a shift and an AND per 16 elements, where widening 8 at a time (attend_item) costs a
 * zero-extending shuffle with its load and a shift per 8. At long contexts that widening was
 * most of the kernel (7,000 tokens, 2 cores of a Xeon with AVX-512: the scores' part took 47
 * us with it, 15 without). So q is split once per (sequence, KV head) into [8 even | 8 odd]
 * per 16-element slice, a score adds the two halves' sums, and the weighted values build up in
 * the same split order, interleaved once at the end. Sums are in a different order from
 * attend_item's: the same scores to float32 rounding, not bitwise. */

static inline __attribute__((always_inline)) void split_bf16(const uint16_t* row, __m256* even, __m256* odd) {
    __m256i x = _mm256_loadu_si256((const __m256i*)row);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* q . k for one position: qs the head's split q, k the position's bf16 row (D % 16 == 0). */
static inline __attribute__((always_inline)) __m256 dot_split(const float* qs, const uint16_t* k, long D) {
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    for (long d = 0; d < D; d += 16) {
        __m256 even, odd;
        split_bf16(k + d, &even, &odd);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), even, c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d + 8), odd, c1);
    }
    return _mm256_add_ps(c0, c1);
}

/* Lane i = the sum of a_i's lanes: eight horizontal sums in 8 cross-lane moves, 4 adds and 3
 * hadds, where one sum a score (hsum8) is a chain of dependent shuffles and adds. */
static inline __attribute__((always_inline)) __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                                            __m256 a5, __m256 a6, __m256 a7) {
    __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
    __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
    __m256 s45 = _mm256_add_ps(_mm256_permute2f128_ps(a4, a5, 0x20), _mm256_permute2f128_ps(a4, a5, 0x31));
    __m256 s67 = _mm256_add_ps(_mm256_permute2f128_ps(a6, a7, 0x20), _mm256_permute2f128_ps(a6, a7, 0x31));
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(s01, s23), _mm256_hadd_ps(s45, s67));  /* a0 a2 a4 a6 | a1 a3 a5 a7 */
    return _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The scores of eight consecutive positions (rows `stride` apart from r) for every head. */
static inline __attribute__((always_inline)) void score8_split(const float* qs, const uint16_t* r, long stride,
                                                               long D, long G, __m256 scale, float* p, long pstride,
                                                               float* mxv) {
    for (long g = 0; g < G; g++) {
        const float* qv = qs + g * D;
        __m256 sc = _mm256_mul_ps(hsum8x8(dot_split(qv, r, D), dot_split(qv, r + stride, D),
                                          dot_split(qv, r + 2 * stride, D), dot_split(qv, r + 3 * stride, D),
                                          dot_split(qv, r + 4 * stride, D), dot_split(qv, r + 5 * stride, D),
                                          dot_split(qv, r + 6 * stride, D), dot_split(qv, r + 7 * stride, D)), scale);
        _mm256_storeu_ps(p + g * pstride, sc);
        _mm256_storeu_ps(mxv + g * 8, _mm256_max_ps(_mm256_loadu_ps(mxv + g * 8), sc));
    }
}

/* os[head] += sum over the rows r .. r + (npos - 1) stride of p[head][pos] * V[pos], split.
 * Heads go two at a time where they can, each 32-element slice of a value row split once for
 * both (8 accumulators): one shift and one AND per head-position fewer on the FMA ports, the
 * same sums in the same order (1.01-1.08x over shapes and contexts, 2 Xeon cores). */
static inline __attribute__((always_inline)) void weigh_split(const uint16_t* r, long stride, long npos,
                                                              const float* p, long pstride, float* os, long D,
                                                              long G) {
    long g = 0;
    /* Two heads at a time, 32 elements at a time: each value row split once for both. */
    for (; g + 2 <= G; g += 2) {
        const float* p0 = p + g * pstride;
        const float* p1 = p0 + pstride;
        for (long d0 = 0; d0 < D; d0 += 32) {
            float* o0 = os + g * D + d0;
            float* o1 = o0 + D;
            if (d0 + 32 > D) {  /* D = 80, 112, ...: a last 16 */
                __m256 a0 = _mm256_loadu_ps(o0), a1 = _mm256_loadu_ps(o0 + 8);
                __m256 b0 = _mm256_loadu_ps(o1), b1 = _mm256_loadu_ps(o1 + 8);
                for (long pos = 0; pos < npos; pos++) {
                    __m256 e, od, x = _mm256_set1_ps(p0[pos]), y = _mm256_set1_ps(p1[pos]);
                    split_bf16(r + pos * stride + d0, &e, &od);
                    a0 = _mm256_fmadd_ps(x, e, a0); a1 = _mm256_fmadd_ps(x, od, a1);
                    b0 = _mm256_fmadd_ps(y, e, b0); b1 = _mm256_fmadd_ps(y, od, b1);
                }
                _mm256_storeu_ps(o0, a0); _mm256_storeu_ps(o0 + 8, a1);
                _mm256_storeu_ps(o1, b0); _mm256_storeu_ps(o1 + 8, b1);
                continue;
            }
            __m256 a0 = _mm256_loadu_ps(o0), a1 = _mm256_loadu_ps(o0 + 8);
            __m256 a2 = _mm256_loadu_ps(o0 + 16), a3 = _mm256_loadu_ps(o0 + 24);
            __m256 b0 = _mm256_loadu_ps(o1), b1 = _mm256_loadu_ps(o1 + 8);
            __m256 b2 = _mm256_loadu_ps(o1 + 16), b3 = _mm256_loadu_ps(o1 + 24);
            for (long pos = 0; pos < npos; pos++) {
                const uint16_t* v = r + pos * stride + d0;
                __m256 e0, od0, e1, od1, x = _mm256_set1_ps(p0[pos]), y = _mm256_set1_ps(p1[pos]);
                split_bf16(v, &e0, &od0);
                split_bf16(v + 16, &e1, &od1);
                a0 = _mm256_fmadd_ps(x, e0, a0); a1 = _mm256_fmadd_ps(x, od0, a1);
                a2 = _mm256_fmadd_ps(x, e1, a2); a3 = _mm256_fmadd_ps(x, od1, a3);
                b0 = _mm256_fmadd_ps(y, e0, b0); b1 = _mm256_fmadd_ps(y, od0, b1);
                b2 = _mm256_fmadd_ps(y, e1, b2); b3 = _mm256_fmadd_ps(y, od1, b3);
            }
            _mm256_storeu_ps(o0, a0); _mm256_storeu_ps(o0 + 8, a1);
            _mm256_storeu_ps(o0 + 16, a2); _mm256_storeu_ps(o0 + 24, a3);
            _mm256_storeu_ps(o1, b0); _mm256_storeu_ps(o1 + 8, b1);
            _mm256_storeu_ps(o1 + 16, b2); _mm256_storeu_ps(o1 + 24, b3);
        }
    }
    for (; g < G; g++) {
        const float* pg = p + g * pstride;
        float* o = os + g * D;
        long d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(o + d0 + 8 * i);
            for (long pos = 0; pos < npos; pos++) {
                const uint16_t* v = r + pos * stride + d0;
                __m256 pj = _mm256_set1_ps(pg[pos]);
                for (int c = 0; c < 4; c++) {
                    __m256 even, odd;
                    split_bf16(v + 16 * c, &even, &odd);
                    a[2 * c] = _mm256_fmadd_ps(pj, even, a[2 * c]);
                    a[2 * c + 1] = _mm256_fmadd_ps(pj, odd, a[2 * c + 1]);
                }
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + d0 + 8 * i, a[i]);
        }
        for (; d0 < D; d0 += 16) {  /* a last slice narrower than 64 (D = 80, 96, ...) */
            __m256 ae = _mm256_loadu_ps(o + d0), ao = _mm256_loadu_ps(o + d0 + 8);
            for (long pos = 0; pos < npos; pos++) {
                __m256 pj = _mm256_set1_ps(pg[pos]), even, odd;
                split_bf16(r + pos * stride + d0, &even, &odd);
                ae = _mm256_fmadd_ps(pj, even, ae);
                ao = _mm256_fmadd_ps(pj, odd, ao);
            }
            _mm256_storeu_ps(o + d0, ae);
            _mm256_storeu_ps(o + d0 + 8, ao);
        }
    }
}

/* attend_item for a bf16 cache with D % 16 == 0; ws: G x (2 D + 9) floats of scratch. */
static inline __attribute__((always_inline)) void attend_item_split(
        const float* q, const uint16_t* kc, const uint16_t* vc, const int32_t* block_tables, long bt_stride,
        const int32_t* seq_lens, float* out, long H, long KVH, long D, long block_size, float scale, long window,
        long max_ctx, long b, long kvh, float* p, float* ws) {
    long G = H / KVH, stride = KVH * D, pst = max_ctx + 8;
    long ctx = seq_lens[b];
    long start = window > 0 && ctx > window ? ctx - window : 0;
    long n = ctx - start;
    const float* qg = q + (b * H + kvh * G) * D;
    const int32_t* table = block_tables + b * bt_stride;
    float* qs = ws;                /* G x D: q, each 16-element slice as [8 even | 8 odd] */
    float* os = ws + G * D;        /* G x D: the weighted values, split the same way */
    float* mxv = ws + 2 * G * D;   /* G x 8: running maxima of the scores */
    float* mx = mxv + 8 * G;       /* G: each head's maximum, then its normaliser */
    for (long g = 0; g < G; g++) {
        for (long d = 0; d < D; d += 16)
            for (long i = 0; i < 8; i++) {
                qs[g * D + d + i] = qg[g * D + d + 2 * i];
                qs[g * D + d + 8 + i] = qg[g * D + d + 2 * i + 1];
            }
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(os + g * D + d, _mm256_setzero_ps());
        _mm256_storeu_ps(mxv + g * 8, _mm256_set1_ps(-INFINITY));
        mx[g] = -INFINITY;
    }
    __m256 sv = _mm256_set1_ps(scale);
    for (long j = start; j < ctx;) {
        long blk = j / block_size, off = j - blk * block_size;
        long stop = (blk + 1) * block_size < ctx ? (blk + 1) * block_size : ctx;
        const uint16_t* kb = kc + ((long)table[blk] * block_size * KVH + kvh) * D;
        if (stop < ctx && table[blk + 1] != table[blk] + 1)
            prefetch_block(kc, ((long)table[blk + 1] * block_size * KVH + kvh) * D, stride, block_size, D, KV_BF16);
        if (D == 64)
            for (; j + 8 <= stop; j += 8, off += 8)
                score8_split(qs, kb + off * stride, stride, 64, G, sv, p + j - start, pst, mxv);
        else
            for (; j + 8 <= stop; j += 8, off += 8)
                score8_split(qs, kb + off * stride, stride, D, G, sv, p + j - start, pst, mxv);
        for (; j < stop; j++, off++)
            for (long g = 0; g < G; g++) {
                float sc = hsum8(dot_split(qs + g * D, kb + off * stride, D)) * scale;
                p[g * pst + j - start] = sc;
                if (sc > mx[g]) mx[g] = sc;
            }
    }
    for (long g = 0; g < G; g++) {
        float hm = hmax8(_mm256_loadu_ps(mxv + g * 8));
        if (hm > mx[g]) mx[g] = hm;
    }
    softmax_heads(p, pst, n, G, mx);
    for (long pos0 = start; pos0 < ctx;) {  /* weighted values, one cache block at a time */
        long blk = pos0 / block_size, off0 = pos0 - blk * block_size;
        long stop = (blk + 1) * block_size < ctx ? (blk + 1) * block_size : ctx;
        const uint16_t* vb = vc + ((long)table[blk] * block_size * KVH + kvh) * D;
        if (stop < ctx && table[blk + 1] != table[blk] + 1)
            prefetch_block(vc, ((long)table[blk + 1] * block_size * KVH + kvh) * D, stride, block_size, D, KV_BF16);
        if (D == 64) weigh_split(vb + off0 * stride, stride, stop - pos0, p + pos0 - start, pst, os, 64, G);
        else weigh_split(vb + off0 * stride, stride, stop - pos0, p + pos0 - start, pst, os, D, G);
        pos0 = stop;
    }
    for (long g = 0; g < G; g++) {  /* interleave the split sums back, normalised */
        float* o = out + (b * H + kvh * G + g) * D;
        const float* src = os + g * D;
        __m256 inv = _mm256_set1_ps(mx[g]);
        for (long d = 0; d < D; d += 16) {
            __m256 even = _mm256_loadu_ps(src + d), odd = _mm256_loadu_ps(src + d + 8);
            __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  /* e0 o0 e1 o1 | e4 o4 e5 o5 */
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), inv));
            _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), inv));
        }
    }
}

static void attend_item_bf16_split(const float* q, const void* k_cache, const void* v_cache,
                                   const int32_t* block_tables, long bt_stride, const int32_t* seq_lens, float* out,
                                   long H, long KVH, long D, long block_size, float scale, long window, long max_ctx,
                                   long b, long kvh, float* p, float* ws) {
    attend_item_split(q, (const uint16_t*)k_cache, (const uint16_t*)v_cache, block_tables, bt_stride, seq_lens, out,
                      H, KVH, D, block_size, scale, window, max_ctx, b, kvh, p, ws);
}

/* ---- Rows of one sequence attended together ----
 *
 * A verification's k + 1 rows (and a draft's catch-up rows) belong to one sequence and walk
 * the same block table, each up to its own position. Attended row by row, every row re-reads
 * the whole context and splits each key and value row again: 5 rows cost 3.9-4.5x one row at
 * 2,000-7,000 tokens (built-in target's heads, 2 Xeon cores), so at long contexts a
 * verification's attention, not its weights, was most of what it added to a decode step.
 * Here each cache block is read once for the R rows: the blocks that every row reads whole go
 * through score8_split and weigh_split once for all R x G query heads (heads of a row
 * contiguous, rows one after the other), the last block or two, which some rows read only
 * part of, row by row. Per head these are the same operations in the same order as
 * attend_item_split's (scores and the weighted values are computed head by head; pairing
 * heads in weigh_split shares a value row's split, not a sum), so each row's output is
 * bitwise what it gets alone: a verified token's logits are a plain decode's. A sliding
 * window whose rows start at different positions goes row by row. p: R G x (max_ctx + 8)
 * floats, ws: R G x (2 D + 9). */
static inline __attribute__((always_inline)) void score_block_split(
        const float* qs, const uint16_t* kb, long stride, long D, long NH, long from, long stop, __m256 sv,
        float scale, float* p, long pst, float* mxv, float* mx) {
    long j = from, off = 0;  /* from: the block's first position */
    if (D == 64)
        for (; j + 8 <= stop; j += 8, off += 8) score8_split(qs, kb + off * stride, stride, 64, NH, sv, p + j, pst, mxv);
    else
        for (; j + 8 <= stop; j += 8, off += 8) score8_split(qs, kb + off * stride, stride, D, NH, sv, p + j, pst, mxv);
    for (; j < stop; j++, off++)
        for (long h = 0; h < NH; h++) {
            float sc = hsum8(dot_split(qs + h * D, kb + off * stride, D)) * scale;
            p[h * pst + j] = sc;
            if (sc > mx[h]) mx[h] = sc;
        }
}

static void attend_group_split(const float* q, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, long bt_stride, const int32_t* seq_lens, float* out,
                               long H, long KVH, long D, long block_size, float scale, long window, long max_ctx,
                               long b0, long R, long kvh, float* p, float* ws) {
    const uint16_t* kc = (const uint16_t*)k_cache;
    const uint16_t* vc = (const uint16_t*)v_cache;
    long G = H / KVH, stride = KVH * D, pst = max_ctx + 8, NH = R * G;
    long lo = seq_lens[b0], hi = seq_lens[b0];
    for (long r = 1; r < R; r++) {
        long c = seq_lens[b0 + r];
        lo = c < lo ? c : lo;
        hi = c > hi ? c : hi;
    }
    if (R == 1 || (window > 0 && hi > window)) {
        for (long r = 0; r < R; r++)
            attend_item_split(q, kc, vc, block_tables, bt_stride, seq_lens, out, H, KVH, D, block_size, scale,
                              window, max_ctx, b0 + r, kvh, p, ws);
        return;
    }
    const int32_t* table = block_tables + b0 * bt_stride;  /* the rows' tables are equal (attend_paged) */
    float* qs = ws;                 /* NH x D: each head's q split as attend_item_split splits it */
    float* os = ws + NH * D;        /* NH x D: the weighted values, split */
    float* mxv = ws + 2 * NH * D;   /* NH x 8 */
    float* mx = mxv + 8 * NH;       /* NH */
    for (long r = 0; r < R; r++)
        for (long g = 0; g < G; g++) {
            long h = r * G + g;
            const float* qv = q + ((b0 + r) * H + kvh * G + g) * D;
            for (long d = 0; d < D; d += 16)
                for (long i = 0; i < 8; i++) {
                    qs[h * D + d + i] = qv[d + 2 * i];
                    qs[h * D + d + 8 + i] = qv[d + 2 * i + 1];
                }
            for (long d = 0; d < D; d += 8) _mm256_storeu_ps(os + h * D + d, _mm256_setzero_ps());
            _mm256_storeu_ps(mxv + h * 8, _mm256_set1_ps(-INFINITY));
            mx[h] = -INFINITY;
        }
    __m256 sv = _mm256_set1_ps(scale);
    for (long j = 0; j < hi; j += block_size) {
        long blk = j / block_size, bend = j + block_size;
        const uint16_t* kb = kc + ((long)table[blk] * block_size * KVH + kvh) * D;
        if (bend < hi && table[blk + 1] != table[blk] + 1)
            prefetch_block(kc, ((long)table[blk + 1] * block_size * KVH + kvh) * D, stride, block_size, D, KV_BF16);
        if (bend <= lo) {
            score_block_split(qs, kb, stride, D, NH, j, bend, sv, scale, p, pst, mxv, mx);
            continue;
        }
        for (long r = 0; r < R; r++) {
            long stop = seq_lens[b0 + r] < bend ? seq_lens[b0 + r] : bend;
            if (stop > j)
                score_block_split(qs + r * G * D, kb, stride, D, G, j, stop, sv, scale, p + r * G * pst, pst,
                                  mxv + r * G * 8, mx + r * G);
        }
    }
    for (long h = 0; h < NH; h++) {
        float hm = hmax8(_mm256_loadu_ps(mxv + h * 8));
        if (hm > mx[h]) mx[h] = hm;
    }
    for (long r = 0; r < R; r++) softmax_heads(p + r * G * pst, pst, seq_lens[b0 + r], G, mx + r * G);
    for (long j = 0; j < hi; j += block_size) {  /* weighted values, one cache block at a time */
        long blk = j / block_size, bend = j + block_size;
        const uint16_t* vb = vc + ((long)table[blk] * block_size * KVH + kvh) * D;
        if (bend < hi && table[blk + 1] != table[blk] + 1)
            prefetch_block(vc, ((long)table[blk + 1] * block_size * KVH + kvh) * D, stride, block_size, D, KV_BF16);
        if (bend <= lo) {
            if (D == 64) weigh_split(vb, stride, block_size, p + j, pst, os, 64, NH);
            else weigh_split(vb, stride, block_size, p + j, pst, os, D, NH);
            continue;
        }
        for (long r = 0; r < R; r++) {
            long stop = seq_lens[b0 + r] < bend ? seq_lens[b0 + r] : bend;
            if (stop > j) {
                if (D == 64) weigh_split(vb, stride, stop - j, p + r * G * pst + j, pst, os + r * G * D, 64, G);
                else weigh_split(vb, stride, stop - j, p + r * G * pst + j, pst, os + r * G * D, D, G);
            }
        }
    }
    for (long r = 0; r < R; r++)
        for (long g = 0; g < G; g++) {  /* interleave the split sums back, normalised */
            long h = r * G + g;
            float* o = out + ((b0 + r) * H + kvh * G + g) * D;
            const float* src = os + h * D;
            __m256 inv = _mm256_set1_ps(mx[h]);
            for (long d = 0; d < D; d += 16) {
                __m256 even = _mm256_loadu_ps(src + d), odd = _mm256_loadu_ps(src + d + 8);
                __m256 lo8 = _mm256_unpacklo_ps(even, odd), hi8 = _mm256_unpackhi_ps(even, odd);
                _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_permute2f128_ps(lo8, hi8, 0x20), inv));
                _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(_mm256_permute2f128_ps(lo8, hi8, 0x31), inv));
            }
        }
}

/* Whether kernel row e reads the same cache blocks as row b over every position either reads. */
static inline int same_blocks(const int32_t* block_tables, long bt_stride, const int32_t* seq_lens, long b, long e,
                              long block_size) {
    long c = seq_lens[b] > seq_lens[e] ? seq_lens[b] : seq_lens[e];
    long nb = (c + block_size - 1) / block_size;
    return memcmp(block_tables + b * bt_stride, block_tables + e * bt_stride, (size_t)nb * sizeof(int32_t)) == 0;
}

/* Rows attended together at most (a verification of k = 15, a catch-up's 16 tokens). */
#define MAX_GROUP_ROWS 16

#define DEFINE_ATTEND_ITEM(NAME, FMT)                                                                        \
static void NAME(const float* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,       \
                 long bt_stride, const int32_t* seq_lens, float* out, long H, long KVH, long D, long block_size, \
                 float scale, long window, long max_ctx, long b, long kvh, float* p, float* mx) {             \
    attend_item(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, H, KVH, D, block_size, scale,    \
                window, max_ctx, b, kvh, p, mx, FMT);                                                        \
}
DEFINE_ATTEND_ITEM(attend_item_f32, KV_F32)
DEFINE_ATTEND_ITEM(attend_item_bf16, KV_BF16)
DEFINE_ATTEND_ITEM(attend_item_f16, KV_F16)

static void attend_paged(const float* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
                         long bt_stride, const int32_t* seq_lens, float* out, long B, long H, long KVH, long D,
                         long block_size, float scale, long window, long max_ctx, int kv_fmt, int threads) {
    long G = H / KVH;
    /* A bf16 cache read in pairs takes runs of rows over the same blocks together (see
     * attend_group_split); every other format row by row. */
    int grouped = kv_fmt == KV_BF16 && D % 16 == 0;
    long* first = (long*)malloc((size_t)(B + 1) * sizeof(long));  /* group i: rows first[i] .. first[i+1]-1 */
    long ngroups = 0, max_rows = 1;
    for (long b = 0; b < B;) {
        long e = b + 1;
        if (grouped)
            while (e < B && e - b < MAX_GROUP_ROWS && same_blocks(block_tables, bt_stride, seq_lens, b, e, block_size))
                e++;
        first[ngroups++] = b;
        if (e - b > max_rows) max_rows = e - b;
        b = e;
    }
    first[ngroups] = B;
    /* Fewer work items than threads (one KV head, one sequence's verification): split the
     * largest group in two until each thread has one. Rows attended apart or together give
     * the same bits; a whole group on one thread ran a 5-row verification 1.7x slower than
     * row by row on two (one KV head, 7,000 tokens). */
    while (grouped && ngroups * KVH < threads) {
        long best = -1, size = 1;
        for (long i = 0; i < ngroups; i++)
            if (first[i + 1] - first[i] > size) { size = first[i + 1] - first[i]; best = i; }
        if (best < 0) break;  /* every group a single row already */
        memmove(first + best + 2, first + best + 1, (size_t)(ngroups - best) * sizeof(long));
        first[best + 1] = first[best] + (size + 1) / 2;
        ngroups++;
    }
    long work = ngroups * KVH;
    int nt = B * KVH * G * max_ctx * D < (1L << 16) ? 1 : threads;  /* small steps: no thread wake-up */
    void (*item)(const float*, const void*, const void*, const int32_t*, long, const int32_t*, float*, long, long,
                 long, long, float, long, long, long, long, float*, float*) =
        kv_fmt == KV_BF16 ? (D % 16 == 0 ? attend_item_bf16_split : attend_item_bf16)
        : kv_fmt == KV_F16 ? attend_item_f16 : attend_item_f32;
    _Pragma("omp parallel num_threads(nt)")
    {
        float* p = (float*)malloc((size_t)max_rows * G * (max_ctx + 8) * sizeof(float));
        float* mx = (float*)malloc((size_t)max_rows * G * (2 * D + 9) * sizeof(float));  /* the split paths' scratch */
        _Pragma("omp for schedule(dynamic, 1)")
        for (long i = 0; i < work; i++) {
            long grp = i / KVH, b0 = first[grp], rows = first[grp + 1] - b0;
            if (grouped)
                attend_group_split(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, H, KVH, D, block_size,
                                   scale, window, max_ctx, b0, rows, i % KVH, p, mx);
            else
                item(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, H, KVH, D, block_size, scale, window,
                     max_ctx, b0, i % KVH, p, mx);
        }
        free(mx);
        free(p);
    }
    free(first);
}

int tailserve_kernels_abi(void) { return 7; }

/* ---- Sampling: each row's top-k / top-p cut-off logit, without sorting the vocabulary ----
 *
 * Row r keeps the logits >= out[r]. top-k: the k-th largest logit (tokens tied with it all
 * stay). top-p on the top-k survivors: in descending order, a token stays while the mass
 * strictly before it is below top_p of the survivors' total; the cut-off is the last one
 * kept (ties with it stay). Both are found by three-way quickselect, expected O(V) per row,
 * where PyTorch's sort took 1.1 ms for 4 x 4096 on a 2-core AVX2 machine. out = -inf when the
 * row filters nothing (top_k >= V and top_p >= 1). Masses are summed in double. */

static inline void swap2(float* a, float* w, long i, long j) {
    float t = a[i]; a[i] = a[j]; a[j] = t;
    if (w) { t = w[i]; w[i] = w[j]; w[j] = t; }
}

static inline float median3(float x, float y, float z) {
    if (x > y) { float t = x; x = y; y = t; }
    if (y > z) { y = z; }
    return x > y ? x : y;
}

/* Partition a[lo:hi] (and w alongside) into > pivot | == pivot | < pivot; returns the
 * bounds of the middle part in *lt, *gt and the weight of the first part in *mg. */
static void partition3(float* a, float* w, long lo, long hi, float pivot, long* lt_out, long* gt_out,
                       double* mg, double* me) {
    long lt = lo, i = lo, gt = hi;
    while (i < gt) {
        if (a[i] > pivot) swap2(a, w, lt++, i++);
        else if (a[i] < pivot) swap2(a, w, i, --gt);
        else i++;
    }
    double g = 0.0, e = 0.0;
    if (w) {
        for (long j = lo; j < lt; j++) g += w[j];
        for (long j = lt; j < gt; j++) e += w[j];
    }
    *lt_out = lt; *gt_out = gt; *mg = g; *me = e;
}

/* The k-th largest of a[0:n] (1 <= k <= n); a is permuted. */
static float kth_largest(float* a, long n, long k) {
    long lo = 0, hi = n;
    while (hi - lo > 1) {
        float pivot = median3(a[lo], a[lo + (hi - lo) / 2], a[hi - 1]);
        long lt, gt; double mg, me;
        partition3(a, NULL, lo, hi, pivot, &lt, &gt, &mg, &me);
        long g = lt - lo, e = gt - lt;
        if (k <= g) hi = lt;
        else if (k <= g + e) return pivot;
        else { k -= g + e; lo = gt; }
    }
    return a[lo];
}

/* The last value kept when taking a[0:n] in descending order until the mass (w) reaches
 * target; a and w are permuted. top: the largest value (kept whatever the target). */
static float mass_cutoff(float* a, float* w, long n, double target, float top) {
    if (target <= 0.0) return top;
    long lo = 0, hi = n;
    float last = top;
    while (hi > lo) {
        float pivot = median3(a[lo], a[lo + (hi - lo) / 2], a[hi - 1]);
        long lt, gt; double mg, me;
        partition3(a, w, lo, hi, pivot, &lt, &gt, &mg, &me);
        if (mg >= target) hi = lt;               /* the cut lies among the larger values */
        else if (mg + me >= target) return pivot;
        else { target -= mg + me; last = pivot; lo = gt; }
    }
    return last;  /* rounding: the mass ran out first; everything down to the last pivot stays */
}

/* Candidates first: one vectorised pass counts (top-k) or weighs (top-p) the logits within a
 * few distances of the largest, and the quickselect runs only on the nearest group that is
 * sure to hold the cut-off (a few dozen tokens for a peaked distribution, all of them for a
 * flat one). */
#define NBAND 4
static const float K_BANDS[NBAND] = {2.0f, 4.0f, 8.0f, 16.0f};  /* logit distance from the top */
static const float P_BANDS[NBAND] = {1e-2f, 1e-4f, 1e-6f, 1e-9f};  /* weight relative to the top */

void tailserve_sampling_cutoffs(const float* logits, long N, long V, long stride, const int64_t* top_k,
                                const float* top_p, float* out, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(N > 4)")
    for (long r = 0; r < N; r++) {
        const float* x = logits + r * stride;
        long k = top_k[r] < V ? (long)top_k[r] : V;
        float p = top_p[r];
        if (k >= V && !(p < 1.0f)) { out[r] = -INFINITY; continue; }
        if (k < 1) k = 1;
        __m256 tv = _mm256_set1_ps(-INFINITY);
        long i = 0;
        for (; i + 8 <= V; i += 8) tv = _mm256_max_ps(tv, _mm256_loadu_ps(x + i));
        float top = hmax8(tv);
        for (; i < V; i++) top = x[i] > top ? x[i] : top;
        float* a = (float*)malloc(sizeof(float) * V * 2);
        float* w = a + V;
        float cut = -INFINITY;
        if (k < V) {
            long cnt[NBAND] = {0};
            __m256i cv[NBAND];
            __m256 lv[NBAND];
            for (int b = 0; b < NBAND; b++) { cv[b] = _mm256_setzero_si256(); lv[b] = _mm256_set1_ps(top - K_BANDS[b]); }
            long j = 0;
            for (; j + 8 <= V; j += 8) {
                __m256 xv = _mm256_loadu_ps(x + j);
                for (int b = 0; b < NBAND; b++)  /* a true compare is all ones: -1 */
                    cv[b] = _mm256_sub_epi32(cv[b], _mm256_castps_si256(_mm256_cmp_ps(xv, lv[b], _CMP_GE_OQ)));
            }
            for (int b = 0; b < NBAND; b++) {
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i*)lanes, cv[b]);
                for (int l = 0; l < 8; l++) cnt[b] += lanes[l];
            }
            for (; j < V; j++)
                for (int b = 0; b < NBAND; b++) cnt[b] += x[j] >= top - K_BANDS[b];
            float lo = -INFINITY;
            for (int b = 0; b < NBAND; b++)
                if (cnt[b] >= k) { lo = top - K_BANDS[b]; break; }
            long n = 0;
            for (long j = 0; j < V; j++)
                if (x[j] >= lo) a[n++] = x[j];
            cut = kth_largest(a, n, k);
        }
        if (p < 1.0f) {
            /* weights of the top-k survivors, and their mass above each band */
            long n = 0;
            for (long j = 0; j < V; j++)
                if (x[j] >= cut) a[n++] = x[j];
            __m256 mv = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-INFINITY);
            long j = 0;
            for (; j + 8 <= n; j += 8) {
                __m256 xv = _mm256_loadu_ps(a + j);
                __m256 e = exp256(_mm256_sub_ps(xv, mv));
                e = _mm256_and_ps(e, _mm256_cmp_ps(xv, ninf, _CMP_GT_OQ));  /* -inf logits weigh 0 */
                _mm256_storeu_ps(w + j, e);
            }
            for (; j < n; j++) w[j] = a[j] == -INFINITY ? 0.0f : expf(a[j] - top);
            /* float lanes, summed in double at the end: the sums only choose the band, and
             * the torch path's float32 softmax has the same rounding. */
            __m256 tacc = _mm256_setzero_ps(), bacc[NBAND], bthr[NBAND];
            for (int b = 0; b < NBAND; b++) { bacc[b] = _mm256_setzero_ps(); bthr[b] = _mm256_set1_ps(P_BANDS[b]); }
            for (j = 0; j + 8 <= n; j += 8) {
                __m256 wv = _mm256_loadu_ps(w + j);
                tacc = _mm256_add_ps(tacc, wv);
                for (int b = 0; b < NBAND; b++)
                    bacc[b] = _mm256_add_ps(bacc[b], _mm256_and_ps(wv, _mm256_cmp_ps(wv, bthr[b], _CMP_GE_OQ)));
            }
            double total = 0.0, band[NBAND] = {0.0};
            {
                float lanes[8];
                _mm256_storeu_ps(lanes, tacc);
                for (int l = 0; l < 8; l++) total += lanes[l];
                for (int b = 0; b < NBAND; b++) {
                    _mm256_storeu_ps(lanes, bacc[b]);
                    for (int l = 0; l < 8; l++) band[b] += lanes[l];
                }
            }
            for (; j < n; j++) {
                total += w[j];
                for (int b = 0; b < NBAND; b++) band[b] += w[j] >= P_BANDS[b] ? w[j] : 0.0f;
            }
            double target = (double)p * total;
            float floor_w = 0.0f;
            for (int b = 0; b < NBAND; b++)
                if (band[b] >= target) { floor_w = P_BANDS[b]; break; }
            long m = 0;
            if (floor_w > 0.0f) {
                for (j = 0; j < n; j++)
                    if (w[j] >= floor_w) { a[m] = a[j]; w[m] = w[j]; m++; }
            } else {
                m = n;
            }
            float c = mass_cutoff(a, w, m, target, top);
            cut = c > cut ? c : cut;
        }
        out[r] = cut;
        free(a);
    }
}

/* ---- One decoder layer of a decode step in one call ------------------------------------
 *
 * The same kernels as the per-operation entry points, in the order DecoderLayer.forward runs
 * them: (residual +=) RMS norm, QKV product, rotary + paged attention, output product,
 * residual += and RMS norm, gate/up product, SiLU * up, down product. A decode step of a
 * small model spends more time between PyTorch operations than in them (measured on the
 * 55M shape at batch 1: ~3 ms of an 8 ms step); this pays one call per layer. Llama-family
 * layers without biases or q/k norms, compact weights (bf16, fp16, or int8 with a float
 * scale per row), float32 activations, up to 16 rows. */
typedef struct {
    int fmt;  /* 0 bf16, 1 fp16, 2 int8, 3 bf16 packed in panels (pack_panels), 4 int8 packed in panels
               * (pack_panels_int8; its scales padded to whole panels) */
    const void *w_qkv, *w_o, *w_gu, *w_down;
    const float *s_qkv, *s_o, *s_gu, *s_down;  /* int8 row scales; NULL otherwise */
    const float *ln1, *ln2;
    float eps, scale;
    long E, H, KVH, D, I;  /* hidden size, heads, KV heads, head size, intermediate size */
} tailserve_layer;

typedef struct {
    const int32_t* block_tables;
    long bt_stride;
    const int32_t* seq_lens;
    const int64_t* slots;
    long M, block_size, window, max_ctx;
    int threads;
    int kv_fmt;  /* the KV cache's format: 0 float32, 1 bf16, 2 fp16 */
} tailserve_step;

static void gemm_fmt(int fmt, const float* x, const void* w, const float* s, float* y, long M, long N, long K,
                     int threads) {
    if (fmt == 3) tailserve_gemm_bf16p(x, (const uint32_t*)w, y, M, N, K, threads);
    else if (fmt == 4) tailserve_gemm_i8p(x, (const int8_t*)w, s, y, M, N, K, threads);
    else if (fmt == 5) tailserve_gemm_w8a8p(x, (const int8_t*)w, s, y, M, N, K, threads);
    else if (fmt == 0) tailserve_gemm_bf16w(x, (const uint16_t*)w, s, y, M, N, K, threads);
    else if (fmt == 1) tailserve_gemm_f16w(x, (const uint16_t*)w, s, y, M, N, K, threads);
    else tailserve_gemm_i8w(x, (const int8_t*)w, s, y, M, N, K, threads);
}

/* h (M, E): the residual stream, updated in place; x: the previous layer's output (M, E), or
 * NULL at the first layer (h then holds the embedding); out (M, E): this layer's output. */
void tailserve_decode_layer(const tailserve_layer* L, const tailserve_step* S, float* h, const float* x,
                            float* out, const float* cos, const float* sin, void* k_cache, void* v_cache) {
    long M = S->M, E = L->E, H = L->H, KVH = L->KVH, D = L->D, I = L->I;
    long nqkv = (H + 2 * KVH) * D;
    int nt = S->threads;
    float* a = (float*)malloc(sizeof(float) * M * (E + nqkv + H * D + 2 * I + I));
    float *qkv = a + M * E, *att = qkv + M * nqkv, *gu = att + M * H * D, *act = gu + M * 2 * I;
    tailserve_add_rms_norm(h, x, L->ln1, a, M, E, L->eps);
    gemm_fmt(L->fmt, a, L->w_qkv, L->s_qkv, qkv, M, nqkv, E, nt);
    tailserve_rope_paged_decode_attention(qkv, nqkv, cos, sin, k_cache, v_cache, S->block_tables, S->bt_stride,
                                          S->seq_lens, S->slots, att, M, H, KVH, D, S->block_size, L->scale,
                                          S->window, S->max_ctx, S->kv_fmt, nt);
    gemm_fmt(L->fmt, att, L->w_o, L->s_o, out, M, E, H * D, nt);  /* out: scratch until the end */
    tailserve_add_rms_norm(h, out, L->ln2, a, M, E, L->eps);
    gemm_fmt(L->fmt, a, L->w_gu, L->s_gu, gu, M, 2 * I, E, nt);
    tailserve_silu_mul(gu, act, M, I);
    gemm_fmt(L->fmt, act, L->w_down, L->s_down, out, M, E, I, nt);
    free(a);
}

/* A whole decode forward of a model whose every layer fuses, in one call: the embedding rows
 * of ids (float32 embed, V x E), each layer as tailserve_decode_layer (k_caches[l], v_caches[l]
 * its cache halves), the final norm of the n_sel selected rows (rows sel_first, sel_first +
 * sel_step, ...: a catch-up's last token per sequence) into hidden (n_sel x E), and with
 * head_w their logits (n_sel x V, the LM head in format head_fmt, scales head_s or NULL). The
 * same calls, in the same order, as the model's Python forward makes for such a step, so the
 * results are bitwise those; what it saves is Python's ~10 calls around each layer: a draft
 * model's chain step (1 layer, 256 wide, 2 Xeon cores) spent more time there than computing.
 * Returns -1, or the first row whose id is outside [0, V) (then nothing is computed). */
long tailserve_decode_model(const tailserve_layer* layers, long n_layers, const tailserve_step* S,
                            const int64_t* ids, const float* embed, const float* cos, const float* sin,
                            void* const* k_caches, void* const* v_caches, const float* norm_w, float norm_eps,
                            long sel_first, long sel_step, long n_sel, int head_fmt, const void* head_w,
                            const float* head_s, long V, float* hidden, float* logits) {
    long M = S->M, E = layers[0].E;
    for (long m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= V) return m;  /* nothing computed: the caller raises */
    float* buf = (float*)malloc(sizeof(float) * 3 * M * E);
    float *h = buf, *x0 = buf + M * E, *x1 = buf + 2 * M * E;
    for (long m = 0; m < M; m++) memcpy(h + m * E, embed + ids[m] * E, sizeof(float) * E);
    const float* x = NULL;  /* the first layer's stream is the embedding itself */
    float* out = x0;
    for (long l = 0; l < n_layers; l++) {
        tailserve_decode_layer(&layers[l], S, h, x, out, cos, sin, k_caches[l], v_caches[l]);
        x = out;
        out = out == x0 ? x1 : x0;
    }
    for (long i = 0; i < n_sel; i++) {
        long r = sel_first + i * sel_step;
        tailserve_add_rms_norm(h + r * E, x + r * E, norm_w, hidden + i * E, 1, E, norm_eps);
    }
    if (head_w) gemm_fmt(head_fmt, hidden, head_w, head_s, logits, n_sel, V, E, S->threads);
    free(buf);
    return -1;
}

/* The largest of x[lo, hi) (-inf where empty), eight at a time; *nan set where one is a NaN. */
static inline float range_max(const float* x, long lo, long hi, int* nan) {
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    long j = lo;
    for (; j + 8 <= hi; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        mx = _mm256_max_ps(v, mx);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float m = hmax8(mx);
    if (_mm256_movemask_ps(un)) *nan = 1;
    for (; j < hi; j++) {
        if (x[j] != x[j]) *nan = 1;
        else if (x[j] > m) m = x[j];
    }
    return m;
}

/* The first index of a row's largest value (*i1) and the largest of the others (*m2, a tie:
 * the same value), by vector passes: a max, a scan for its first index, the max on either
 * side of it. Returns 0, writing nothing, where the row holds a NaN (each caller has its own
 * rule for one). The scalar compare-and-branch loops took ~9 us a 4,096-token row on one
 * Xeon core, per draft token. */
static int top2_first(const float* x, long V, long* i1, float* m2) {
    int nan = 0;
    const float m1 = range_max(x, 0, V, &nan);
    if (nan) return 0;
    const __m256 mv = _mm256_set1_ps(m1);
    long j = 0;
    for (; j + 8 <= V; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mv, _CMP_EQ_OQ));
        if (hit) { j += __builtin_ctz((unsigned)hit); break; }
    }
    while (j < V && x[j] != m1) j++;  /* no hit in the vectors: the tail */
    if (j >= V) j = 0;  /* every value -inf: argmax's first index */
    *i1 = j;
    const float a = range_max(x, 0, j, &nan), b = range_max(x, j + 1, V, &nan);
    *m2 = a > b ? a : b;
    return 1;
}

void tailserve_top2_margin(const float* logits, long N, long V, long stride, int64_t* top, float* margin);

/* q = the draft's sampling distribution over V (sample/sampler.py filtered_probs): logits /
 * temperature (the division in float32, PyTorch's bits), the tokens under the top-k / top-p
 * cut-off (tailserve_sampling_cutoffs, the kernel filtered_probs itself calls) at -inf, the
 * softmax (exp by exp256, the sum in double), then min-p: tokens under min_p times the largest
 * probability to 0 and the rest renormalised. top_k >= V, top_p >= 1 and min_p <= 0 filter
 * nothing. Not PyTorch's bits (its softmax has its own exp), which a draft's q need not be:
 * the draft samples from this q and the rejection sampler reads this q, and a seeded request's
 * output is its race under the target's p whatever the draft proposed. */
static void draft_q(const float* logits, long V, float temperature, int64_t top_k, float top_p, float min_p,
                    float* q) {
    /* The division and the scaling by 1 / sum vectorised (IEEE operations: the same bits as
     * one at a time), the largest value by max: a 4,096-token row's q took 6.6 us on one Xeon
     * core with the scalar loops, 2.6 us so (paid per draft of a sampled request). */
    __m256 tv = _mm256_set1_ps(temperature), mx = _mm256_set1_ps(-INFINITY);
    long i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 z = _mm256_div_ps(_mm256_loadu_ps(logits + i), tv);
        _mm256_storeu_ps(q + i, z);
        mx = _mm256_max_ps(z, mx);  /* a NaN z leaves mx, as the scalar compare does */
    }
    float m = hmax8(mx);
    for (; i < V; i++) {
        q[i] = logits[i] / temperature;
        if (q[i] > m) m = q[i];
    }
    if (top_k < V || top_p < 1.0f) {
        float cut;
        tailserve_sampling_cutoffs(q, 1, V, V, &top_k, &top_p, &cut, 1);
        for (long x = 0; x < V; x++) if (q[x] < cut) q[x] = -INFINITY;
    }
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    long x = 0;
    for (; x + 8 <= V; x += 8) {
        __m256 zv = _mm256_loadu_ps(q + x);
        __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(zv, mv)), _mm256_cmp_ps(zv, ninf, _CMP_GT_OQ));
        _mm256_storeu_ps(q + x, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    double s = 0.0;
    for (int l = 0; l < 8; l++) s += lanes[l];
    for (; x < V; x++) {
        q[x] = q[x] == -INFINITY ? 0.0f : expf(q[x] - m);
        s += q[x];
    }
    float inv = (float)(1.0 / s);
    __m256 iv = _mm256_set1_ps(inv);
    for (x = 0; x + 8 <= V; x += 8) _mm256_storeu_ps(q + x, _mm256_mul_ps(_mm256_loadu_ps(q + x), iv));
    for (; x < V; x++) q[x] *= inv;
    if (min_p > 0.0f) {
        float top = 0.0f;
        for (x = 0; x < V; x++) if (q[x] > top) top = q[x];
        const float threshold = min_p * top;
        s = 0.0;
        for (x = 0; x < V; x++) {
            if (q[x] < threshold) q[x] = 0.0f;
            s += q[x];
        }
        inv = (float)(1.0 / s);
        for (x = 0; x < V; x++) q[x] *= inv;
    }
}

static inline long inverse_cdf_row(const float* p, double u, long V);
void tailserve_seeded_race(const float* probs, long stride, const uint64_t* keys, long N, long V,
                           int64_t* out, int threads);

/* One draft per row of logits: mode 0 (greedy) the argmax, margin p(top) - p(second) of the
 * softmax (tailserve_top2_margin); 1 (sampled) and 2 (seeded): q = draft_q written to q, the draft
 * by inverse CDF at u (1) or the exponential race with key (2), margin q(top) - q(second). */
static int64_t draft_pick(const float* logits, long V, int mode, float temperature, int64_t top_k, float top_p,
                          float min_p, double u, const uint64_t* key, float* q, float* margin) {
    int64_t token;
    if (mode == 0) {
        tailserve_top2_margin(logits, 1, V, V, &token, margin);
        return token;
    }
    draft_q(logits, V, temperature, top_k, top_p, min_p, q);
    if (mode == 1) token = inverse_cdf_row(q, u, V);
    else tailserve_seeded_race(q, V, key, 1, V, &token, 1);
    long i1 = 0;
    float m2 = -INFINITY;
    if (!top2_first(q, V, &i1, &m2)) {
        for (long x = 1; x < V; x++) if (q[x] > q[i1]) i1 = x;
        for (long x = 0; x < V; x++) if (x != i1 && q[x] > m2) m2 = q[x];
    }
    *margin = q[i1] - m2;  /* as q.topk(2)'s two values subtract */
    return token;
}

/* A round of drafts for B sequences in one call (speculative/proposer.py, DraftModelProposer
 * .propose on the usual catch-up): step 0 feeds each sequence's last qn tokens (ids0, row-major;
 * row b's first at position first_pos[b], its first pad[b] only repeating cached tokens, so their
 * K/V go to scratch_slot) and drafts from each sequence's last row; each later step feeds the
 * previous draft of every sequence still drafting at its next position. Each step is the same
 * tailserve_decode_model call as the Python step's, row for row (the sequence's block table, its
 * rows' lengths, slots and rotary rows by position, copied into table_buf and rope_buf), so the
 * K/V written are bitwise its own. Per sequence: modes[b] as draft_pick, with temps, top_ks,
 * top_ps, min_ps, the uniforms or keys of its drafts at uniforms[b * kmax + n] / keys[...];
 * steps[b] drafts at most, fewer after one whose margin falls below stop_margin > 0. Writes
 * out[b * kmax + n], q_out[(b * kmax + n) * V] (sampled rows) and counts[b]. Returns -1, or
 * where a fed token lies outside the vocabulary (nothing more computed: the caller raises): its
 * row in ids0 at step 0, -2 - its sequence later.
 * Python paid ~45 us a chain step around a ~100 us compiled forward and ~50 us to sample
 * (2 Xeon cores). */
long tailserve_draft_rounds(const tailserve_layer* layers, long n_layers, tailserve_step* S, long B, long qn,
                            const int64_t* ids0, const int64_t* first_pos, const int64_t* pad, int64_t scratch_slot,
                            const int64_t* steps, long kmax, const int32_t* tables, long W, int32_t* table_buf,
                            const float* cos_table, const float* sin_table, long D, float* rope_buf,
                            void* const* k_caches, void* const* v_caches, const float* embed, const float* norm_w,
                            float norm_eps, int head_fmt, const void* head_w, const float* head_s, long V,
                            const int32_t* modes, const float* temps, const int64_t* top_ks, const float* top_ps,
                            const float* min_ps, const double* uniforms, const uint64_t* keys, double stop_margin,
                            float* hidden, float* logits, float* q_out, int64_t* out, int64_t* counts) {
    int32_t* seq_lens = (int32_t*)S->seq_lens;
    int64_t* slots = (int64_t*)S->slots;
    const long bs = S->block_size;
    const long R = B * qn;  /* rows of the widest step (step 0) */
    float* cos_rows = rope_buf;
    float* sin_rows = rope_buf + R * D;
    int64_t* ids = (int64_t*)malloc(sizeof(int64_t) * R);
    /* rowseq[m]: the sequence row m of a chain step drafts for; rowseq[B + b]: -1 once b stopped */
    long* rowseq = (long*)malloc(sizeof(long) * 2 * B);
    long active = 0;
    for (long b = 0; b < B; b++) counts[b] = 0;
    for (long s = 0; s < kmax; s++) {
        long m = 0, max_ctx = 0;
        if (s == 0) {
            for (long b = 0; b < B; b++)
                for (long j = 0; j < qn; j++, m++) {
                    const long p = first_pos[b] + j;
                    const int32_t* t = tables + b * W;
                    ids[m] = ids0[m];
                    seq_lens[m] = (int32_t)(p + 1);
                    slots[m] = j < pad[b] ? scratch_slot : (int64_t)t[p / bs] * bs + p % bs;
                    memcpy(table_buf + m * W, t, sizeof(int32_t) * W);
                    memcpy(cos_rows + m * D, cos_table + p * D, sizeof(float) * D);
                    memcpy(sin_rows + m * D, sin_table + p * D, sizeof(float) * D);
                    if (p + 1 > max_ctx) max_ctx = p + 1;
                }
        } else {
            for (long b = 0; b < B; b++) {
                if (counts[b] != s || steps[b] <= s || rowseq[B + b] < 0) continue;  /* stopped or done */
                const long p = first_pos[b] + qn - 1 + s;
                const int32_t* t = tables + b * W;
                ids[m] = out[b * kmax + s - 1];
                seq_lens[m] = (int32_t)(p + 1);
                slots[m] = (int64_t)t[p / bs] * bs + p % bs;
                memcpy(table_buf + m * W, t, sizeof(int32_t) * W);
                memcpy(cos_rows + m * D, cos_table + p * D, sizeof(float) * D);
                memcpy(sin_rows + m * D, sin_table + p * D, sizeof(float) * D);
                if (p + 1 > max_ctx) max_ctx = p + 1;
                rowseq[m] = b;
                m++;
            }
            if (m == 0) break;
        }
        S->M = m;
        S->max_ctx = max_ctx;  /* as the step's own metadata has it (it sizes the scores' rows) */
        const long n_sel = s == 0 ? B : m;
        const long bad = tailserve_decode_model(layers, n_layers, S, ids, embed, cos_rows, sin_rows, k_caches, v_caches,
                                                norm_w, norm_eps, s == 0 ? qn - 1 : 0, s == 0 ? qn : 1, n_sel, head_fmt,
                                                head_w, head_s, V, hidden, logits);
        if (bad >= 0) {
            const long ret = s == 0 ? bad : -2 - rowseq[bad];  /* step 0: a row of ids0; later: -2 - sequence */
            free(ids);
            free(rowseq);
            return ret;
        }
        active = 0;
        for (long r = 0; r < n_sel; r++) {
            const long b = s == 0 ? r : rowseq[r];
            const long n = b * kmax + counts[b];
            float margin;
            out[n] = draft_pick(logits + r * V, V, modes[b], temps[b], top_ks[b], top_ps[b], min_ps[b],
                                uniforms ? uniforms[n] : 0.0, keys ? keys + n : NULL, q_out + n * V, &margin);
            counts[b]++;
            if (stop_margin > 0.0 && V >= 2 && (double)margin < stop_margin) rowseq[B + b] = -1;  /* as Python compares */
            else if (s == 0) rowseq[B + b] = 0;
            active += rowseq[B + b] >= 0 && steps[b] > counts[b];
        }
        if (active == 0) break;
    }
    free(ids);
    free(rowseq);
    return -1;
}

/* Grammar masks (structured outputs): logits[rows[r], t] = -inf where bit t % 32 of
 * mask[r, t / 32] is clear. Words that allow everything are skipped and words that allow
 * nothing are filled 32 at a time: under a JSON grammar nearly every word is one or the
 * other, so a 150k-vocabulary row costs about one pass over its 4,700 words. */
void tailserve_apply_token_bitmask(float* logits, long stride, const int64_t* rows, const int32_t* mask,
                                   long R, long V, long W, int threads) {
    const float ninf = -INFINITY;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(R * V > (1L << 20))")
    for (long r = 0; r < R; r++) {
        float* x = logits + rows[r] * stride;
        const uint32_t* m = (const uint32_t*)(mask + r * W);
        for (long w = 0; w < W; w++) {
            uint32_t b = m[w];
            if (b == 0xffffffffu) continue;
            long base = w * 32, end = base + 32 < V ? base + 32 : V;
            if (b == 0) {
                for (long t = base; t < end; t++) x[t] = ninf;
            } else {
                for (long t = base; t < end; t++)
                    if (!((b >> (t - base)) & 1u)) x[t] = ninf;
            }
        }
    }
}

/* Seeded sampling's exponential race (sample/sampler.py, SeededNoise): per row r the token
 * x maximising p[x] / E[x], E[x] = -log(u[x]) with u[x] = (fmix32(fmix32(x ^ hi) + lo) + 0.5)
 * / 2^32 from the row's key (lo, hi = its 32-bit halves), first maximum on ties: the same
 * winner as the PyTorch formula. Most tokens cannot win: p/E <= best <=> u <= exp(-p/best),
 * implied by u <= 1 - p/best, a multiply and a compare with no logarithm; the scan starts
 * from the most likely token so that best is large from the start. */
static inline uint32_t tailserve_fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

void tailserve_seeded_race(const float* probs, long stride, const uint64_t* keys, long N, long V,
                           int64_t* out, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(N * V > (1L << 20))")
    for (long r = 0; r < N; r++) {
        const float* p = probs + r * stride;
        const uint32_t lo = (uint32_t)keys[r], hi = (uint32_t)(keys[r] >> 32);
        long best = 0;
        float pm = p[0];
        for (long x = 1; x < V; x++) if (p[x] > pm) { pm = p[x]; best = x; }
        double bestval = -1.0;
        if (pm > 0.0f) {
            double u = ((double)tailserve_fmix32(tailserve_fmix32((uint32_t)best ^ hi) + lo) + 0.5) * 0x1p-32;
            bestval = (double)pm / -log(u);
        }
        double inv = bestval > 0 ? 1.0 / bestval : 0.0;
        for (long x = 0; x < V; x++) {
            const float px = p[x];
            if (!(px > 0.0f)) continue;
            const double u = ((double)tailserve_fmix32(tailserve_fmix32((uint32_t)x ^ hi) + lo) + 0.5) * 0x1p-32;
            if (u + (double)px * inv <= 1.0) continue;  /* cannot beat best */
            const double v = (double)px / -log(u);
            if (v > bestval || (v == bestval && x < best)) { best = x; bestval = v; inv = 1.0 / v; }
        }
        out[r] = best;
    }
}

/* Unseeded sampling by inverting each row's cumulative distribution at u[r] (sample/sampler.py,
 * sample_from_probs, the definition): the first token whose running sum, in double in token
 * order as PyTorch's CPU cumsum adds, exceeds u[r] times the row's total; the last token if
 * none does. Two passes over the row in one call, where the PyTorch formula is seven small ops
 * (~40 us a step at batch 1 on 2 AVX2 cores, most of it per-op overhead). */
static inline long inverse_cdf_row(const float* p, double u, long V) {
    double total = 0.0;
    for (long x = 0; x < V; x++) total += (double)p[x];
    const double target = u * total;
    double c = 0.0;
    for (long x = 0; x < V; x++) {
        c += (double)p[x];
        if (c > target) return x;
    }
    return V - 1;
}

void tailserve_inverse_cdf(const float* probs, long stride, const double* u, long N, long V, int64_t* out,
                           int threads) {
    if (N < 4) {  /* no parallel region at all: it would cost more than a row */
        for (long r = 0; r < N; r++) out[r] = inverse_cdf_row(probs + r * stride, u[r], V);
        return;
    }
    /* A row is two chains of dependent double adds (~4 cycles each): rows in parallel. */
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (long r = 0; r < N; r++) out[r] = inverse_cdf_row(probs + r * stride, u[r], V);
}

/* Speculative verification of sampled requests (sample/rejection.py; the PyTorch functions
 * rejection_sample_probs / block_verify_probs are the definition, this is the same rule in
 * one call: on a small CPU the dozens of tensor operations cost more than the arithmetic).
 * Request b owns target rows [pstart_b, pstart_b + k_b] of probs (filtered, normalised) and
 * draft rows [qstart_b, qstart_b + k_b) of q (NULL: one-hot drafts), its draft ids and
 * uniforms at the same offsets as its q rows. Writes its accepted count and final token. */
static long tailserve_draw(const float* p, const float* q, long skip, double scale, long V, double u) {
    /* Inverse CDF at u of w = max(0, scale * p - q) (q NULL: scale * p with token `skip` at
     * zero; skip < 0: none), or of p where w has no mass. */
    double total = 0.0;
    for (long v = 0; v < V; v++) {
        double w = q ? scale * p[v] - q[v] : (v == skip ? 0.0 : scale * p[v]);
        if (w > 0) total += w;
    }
    int use_p = !(total > 0);
    if (use_p) { total = 0.0; for (long v = 0; v < V; v++) total += p[v]; }
    double target = u * total, c = 0.0;
    long last = 0;
    for (long v = 0; v < V; v++) {
        double w = use_p ? p[v] : (q ? scale * p[v] - q[v] : (v == skip ? 0.0 : scale * p[v]));
        if (!(w > 0)) continue;
        c += w;
        last = v;
        if (c > target) return v;
    }
    return last;
}

void tailserve_verify_drafts(const float* probs, long stride, const float* q, long qstride, const int64_t* ids,
                             const float* uniform, const double* final_u, const int64_t* num_drafts, long B, long V,
                             int block, int64_t* num_accepted, int64_t* final_tok, int threads) {
    long pstart = 0, qstart = 0;
    for (long b = 0; b < B; b++) {
        const long k = num_drafts[b];
        const float* P = probs + pstart * stride;
        const float* Q = q ? q + qstart * qstride : NULL;
        const int64_t* x = ids + qstart;
        const float* u = uniform + qstart;
        long m = 0, tok;
        if (!block || k == 0) {
            while (m < k) {
                double px = P[m * stride + x[m]], qx = Q ? Q[m * qstride + x[m]] : 1.0f;
                float a = (float)px / fmaxf((float)qx, 1e-30f);
                if (!(u[m] < fminf(a, 1.0f))) break;
                m++;
            }
            if (m < k) tok = tailserve_draw(P + m * stride, Q ? Q + m * qstride : NULL, Q ? -1 : x[m], 1.0, V,
                                            final_u[b]);
            else tok = tailserve_draw(P + k * stride, NULL, -1, 1.0, V, final_u[b]);
        } else {
            /* p_i = min(1, p_(i-1) p(x_i) / q(x_i)); h_i = mass_i / (mass_i + 1 - p_i), h_k = p_k;
             * tau = the last i with u_(i-1) < h_i (0 if none). */
            double pv = 1.0;
            m = 0;
            for (long i = 1; i <= k; i++) {
                const float* Pi = P + (i - 1) * stride;
                const float* Qi = Q ? Q + (i - 1) * qstride : NULL;
                double px = Pi[x[i - 1]], qx = Qi ? Qi[x[i - 1]] : 1.0;
                pv = fmin(1.0, pv * (px / fmax(qx, 1e-30)));
                double h;
                if (i == k) {
                    h = pv;
                } else {
                    const float* Pn = P + i * stride;
                    const float* Qn = Q ? Q + i * qstride : NULL;
                    double mass = 0.0;
                    for (long v = 0; v < V; v++) {
                        double w = Qn ? pv * Pn[v] - Qn[v] : (v == x[i] ? 0.0 : pv * Pn[v]);
                        if (w > 0) mass += w;
                    }
                    double den = mass + 1.0 - pv;
                    h = den > 0 ? mass / den : 1.0;
                }
                if (u[i - 1] < h) m = i;
            }
            if (m == k) {
                tok = tailserve_draw(P + k * stride, NULL, -1, 1.0, V, final_u[b]);
            } else {
                double pm = 1.0;  /* p_m again */
                for (long i = 1; i <= m; i++) {
                    double px = P[(i - 1) * stride + x[i - 1]], qx = Q ? Q[(i - 1) * qstride + x[i - 1]] : 1.0;
                    pm = fmin(1.0, pm * (px / fmax(qx, 1e-30)));
                }
                tok = tailserve_draw(P + m * stride, Q ? Q + m * qstride : NULL, Q ? -1 : x[m], pm, V, final_u[b]);
            }
        }
        num_accepted[b] = m;
        final_tok[b] = tok;
        pstart += k + 1;
        qstart += k;
    }
    (void)threads;
}

/* -- suffix decoding's walk (speculative/suffix.py `_walk`), step by step ------------------
 * The NumPy walk pays ~3-10 us a NumPy call and makes dozens a proposal (~250 us of a ~2 ms
 * step on repeated text); this is the same walk in one call. `tokens` (n) is the text, its
 * last `plen` tokens the pattern (a request's own context), or the global cache with the
 * pattern given apart and `where` its list of pattern[-1]'s positions (those below `base`
 * evicted). Every step is the Python one's, in the same float64 operations: the match
 * extended back a token at a time over the occurrences that still agree, then per draft token
 * the most frequent continuation (ties to the smaller id, as np.unique then argmax), its count
 * over the valid continuations times the probability so far, admitted as `_admit` does.
 * info[0] = the match length, info[1] = the bucket whose hold was consulted (the caller counts
 * it) or -1. Returns the draft's length. */
static int cmp_i64(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return (x > y) - (x < y);
}

#define DEFINE_SUFFIX_WALK(NAME, TT)                                                                   \
long NAME(const TT* tokens, long n, const int32_t* where, long num_where, long base, const TT* pattern, \
          long plen, long k, double max_spec_factor, double min_token_prob, const double* scales,      \
          const uint8_t* probe, int calibrated, int64_t* out_tokens, double* out_cum, int64_t* info,   \
          double* out_score) {                                                                        \
    info[0] = 0; info[1] = -1; *out_score = 0.0;                                                     \
    if (plen <= 0 || n <= 0) return 0;                                                               \
    TT last = pattern[plen - 1];                                                                     \
    long cap = where ? num_where : n;                                                                \
    int64_t* ends = malloc(sizeof(int64_t) * 2 * (size_t)(cap > 0 ? cap : 1));                       \
    int64_t* nxt = ends + (cap > 0 ? cap : 1);                                                       \
    long E = 0;                                                                                      \
    if (where) {                                                                                     \
        for (long i = 0; i < num_where; i++) if (where[i] >= base) ends[E++] = where[i];             \
    } else {                                                                                         \
        for (long i = 0; i + 1 < n; i++) if (tokens[i] == last) ends[E++] = i;                       \
    }                                                                                                \
    if (E == 0) { free(ends); return 0; }                                                            \
    long m = 1;                                                                                      \
    while (m < plen) {                                                                               \
        TT want = pattern[plen - 1 - m];                                                             \
        long keep = 0;                                                                               \
        for (long i = 0; i < E; i++) {                                                               \
            int64_t p = ends[i] - m;                                                                 \
            if (p >= 0 && tokens[p] == want) keep++;                                                 \
        }                                                                                            \
        if (keep == 0) break;                                                                        \
        long j = 0;                                                                                  \
        for (long i = 0; i < E; i++) {                                                               \
            int64_t p = ends[i] - m;                                                                 \
            if (p >= 0 && tokens[p] == want) ends[j++] = ends[i];                                    \
        }                                                                                            \
        E = j;                                                                                       \
        m++;                                                                                         \
    }                                                                                                \
    info[0] = m;                                                                                     \
    long bucket = (m < 8 ? m : 8) - 1;                                                               \
    double scale = calibrated ? scales[bucket] : 1.0;                                                \
    long limit = (long)(max_spec_factor * (double)m);                                                \
    if (limit > k) limit = k;                                                                        \
    double prob = 1.0, score = 0.0;                                                                  \
    long d = 0;                                                                                      \
    while (d < limit) {                                                                              \
        long nv = 0, j = 0;                                                                          \
        for (long i = 0; i < E; i++) {                                                               \
            if (ends[i] + 1 >= n) continue;                                                          \
            ends[j] = ends[i];                                                                       \
            TT t = tokens[ends[i] + 1];                                                              \
            if (t >= 0) nxt[nv++] = t;                                                               \
            j++;                                                                                     \
        }                                                                                            \
        E = j;                                                                                       \
        if (nv == 0) break;                                                                          \
        int64_t tok = nxt[0];                                                                        \
        long count = nv;                                                                             \
        int unanimous = 1;                                                                           \
        for (long i = 1; i < nv; i++) if (nxt[i] != tok) { unanimous = 0; break; }                   \
        if (!unanimous) {                                                                            \
            qsort(nxt, (size_t)nv, sizeof(int64_t), cmp_i64);                                        \
            count = 0;                                                                               \
            for (long i = 0; i < nv;) {                                                              \
                long r = i;                                                                          \
                while (r < nv && nxt[r] == nxt[i]) r++;                                              \
                if (r - i > count) { count = r - i; tok = nxt[i]; }                                  \
                i = r;                                                                               \
            }                                                                                        \
        }                                                                                            \
        prob *= (double)count / (double)nv;                                                          \
        double scaled = prob * scale < 1.0 ? prob * scale : 1.0;                                     \
        if (!(scaled >= min_token_prob)) {                                                           \
            if (d > 0 || !calibrated || prob < min_token_prob) break;                                \
            info[1] = bucket;                                                                        \
            if (!probe[bucket]) break;                                                               \
            scale = 1.0;                                                                             \
            scaled = prob;                                                                           \
        }                                                                                            \
        out_tokens[d] = tok;                                                                         \
        out_cum[d] = prob;                                                                           \
        d++;                                                                                         \
        score += scaled;                                                                             \
        j = 0;                                                                                       \
        for (long i = 0; i < E; i++) if (tokens[ends[i] + 1] == (TT)tok) ends[j++] = ends[i] + 1;    \
        E = j;                                                                                       \
    }                                                                                                \
    *out_score = score;                                                                              \
    free(ends);                                                                                      \
    return d;                                                                                        \
}
DEFINE_SUFFIX_WALK(tailserve_suffix_walk_i64, int64_t)
DEFINE_SUFFIX_WALK(tailserve_suffix_walk_i32, int32_t)

/* A greedy draft's token and how sure the draft is of it, per row of float32 logits (N, V):
 * top[r] = the first maximum (argmax's rule), margin[r] = p(top) - p(second) of the row's
 * softmax = (1 - exp(l2 - l1)) / sum_j exp(l_j - l1), the second being the largest of the
 * others (a tie: 0). The draft stops below speculative_draft_stop_margin; PyTorch's softmax
 * and topk cost ~40 us a chain step here for what one pass computes. */
void tailserve_top2_margin(const float* logits, long N, long V, long stride, int64_t* top, float* margin) {
    for (long r = 0; r < N; r++) {
        const float* x = logits + r * stride;
        long i1 = 0;
        float m2 = -INFINITY;
        if (!top2_first(x, V, &i1, &m2)) {
            float m = x[0];
            for (long j = 1; j < V; j++)
                if (x[j] > m || (x[j] != x[j] && m == m)) { m = x[j]; i1 = j; }  /* a NaN counts as largest */
            for (long j = 0; j < V; j++)
                if (j != i1 && x[j] > m2) m2 = x[j];
        }
        const float m1 = x[i1];
        __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m1), ninf = _mm256_set1_ps(-INFINITY);
        long j = 0;
        for (; j + 8 <= V; j += 8) {
            __m256 xv = _mm256_loadu_ps(x + j);
            __m256 e = exp256(_mm256_sub_ps(xv, mv));
            acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_cmp_ps(xv, ninf, _CMP_GT_OQ)));  /* -inf weighs 0 */
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        double s = 0.0;
        for (int l = 0; l < 8; l++) s += lanes[l];
        for (; j < V; j++) s += x[j] == -INFINITY ? 0.0 : exp((double)x[j] - m1);
        top[r] = i1;
        margin[r] = m1 != m1 || s <= 0.0 ? 0.0f : (float)((1.0 - exp((double)m2 - m1)) / s);
    }
}
