/* y = x @ W^T (+ bias) in fp32 on AVX-512 (CPU).
 *
 * A decode step multiplies a few dozen rows by every weight of the model once, so
 * each weight streams from memory while it is used: the step takes as long as
 * reading the weights plus computing with them unless the two overlap.  oneDNN's
 * fp32 GEMM does not overlap them here (one SmolLM2 decode step's projections at
 * 32 rows: 47 ms, against 22 ms of arithmetic at its in-cache rate and 20 ms to
 * read 540 MB).  This kernel reads each weight from a layout packed for it and
 * prefetches the next panel of weights while it computes with the current one.
 *
 * Packed layout (parrot_f32_pack): W [N, K] is cut into panels of PANEL = 32 output
 * columns, zero-padded to ceil(N / 32) panels; panel p is [K][32] contiguous: its
 * element (k, c) is W[p * 32 + c][k].
 *
 * Per call: rows are taken in chunks of at most ROWS (the chunk's x stays in cache);
 * threads take contiguous runs of panels; within a panel, groups of 12, 8, 4, 2 or 1
 * rows keep 2 x MR accumulator vectors over k (each row's x[k] broadcast, the panel's
 * 32 weights of k as two vectors); every group also prefetches its share of the next
 * panel of the thread's run, so the whole panel is in flight by the time it is used.
 * Each output element is one fp32 sum over k in order, whatever the row count or the
 * thread count (batch-invariant), plus the bias.
 *
 * Invariants: y [M, N] is fully written; padding columns are never written; the
 * weight is not changed.  NaN and inf propagate as in the plain sums.  The AVX-512
 * kernel is built where the compiler targets AVX-512F and PARROT_PORTABLE is not
 * defined (parrot_f32_linear_supported: the engine uses the kernel only then);
 * every other build computes the same sums in portable C (one fmaf per k, in order,
 * then the bias: the same bits), so the packed layout and the results are tested on
 * every CPU.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parrot_ops.h"

#define PANEL 32
#define ROWS 256

/* Elements of the packed copy of an [n, k] weight. */
int64_t parrot_f32_packed_size(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

/* w: [n, k] fp32 row-major; packed: parrot_f32_packed_size(n, k) elements. */
void parrot_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t row = p * PANEL + c;
                packed[(p * k + kk) * PANEL + c] = row < n ? w[row * k + kk] : 0.0f;
            }
}

#if defined(__AVX512F__) && !defined(PARROT_PORTABLE)
#define F32_AVX512 1
#include <immintrin.h>
#include <omp.h>

/* Rows [0, MR) of x (stride ldx) times one panel into y (stride ldy), columns
 * [0, ncols) of the panel (ncols <= 32 written), plus bias (or none).  While it runs,
 * prefetches `share` floats from pf into L2 (none when pf is NULL). */
#define DEFINE_GROUP(MR)                                                                                       \
    static inline __attribute__((always_inline)) void group##MR(const float *x, int64_t ldx, const float *panel, \
                                                                int64_t k, float *y, int64_t ldy, int64_t ncols, \
                                                                const float *bias, const float *pf,              \
                                                                int64_t groups) {                                \
        __m512 lo[MR], hi[MR];                                                                                   \
        for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm512_setzero_ps();                                        \
        for (int64_t kk = 0; kk < k; kk++) {                                                                     \
            if (pf) __builtin_prefetch(pf + kk * PANEL / groups, 0, 2);                                          \
            const __m512 w0 = _mm512_loadu_ps(panel + kk * PANEL), w1 = _mm512_loadu_ps(panel + kk * PANEL + 16); \
            for (int r = 0; r < MR; r++) {                                                                       \
                const __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);                                               \
                lo[r] = _mm512_fmadd_ps(xb, w0, lo[r]);                                                          \
                hi[r] = _mm512_fmadd_ps(xb, w1, hi[r]);                                                          \
            }                                                                                                    \
        }                                                                                                        \
        const __mmask16 m0 = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);                             \
        const __mmask16 m1 = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1u);    \
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();                          \
        const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();                     \
        for (int r = 0; r < MR; r++) {                                                                           \
            _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(lo[r], b0));                                    \
            _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(hi[r], b1));                              \
        }                                                                                                        \
    }
DEFINE_GROUP(12)
DEFINE_GROUP(8)
DEFINE_GROUP(4)
DEFINE_GROUP(2)
DEFINE_GROUP(1)

/* Rows [0, m) of x times panel p (output columns n0 = p * 32 ...); prefetches the
 * panel at pf (or nothing), split between the row groups. */
static void panel_rows(const float *x, int64_t m, int64_t k, const float *panel, float *y, int64_t n, int64_t n0,
                       const float *bias, const float *pf) {
    const int64_t ncols = n - n0 < PANEL ? n - n0 : PANEL;
    const float *b = bias ? bias + n0 : NULL;
    /* 12 and 8 are multiples of 4, so the groups below are m / 12, then one of 8, 4,
     * 2 and 1 as the remainders ask */
    const int64_t groups = m / 12 + (m % 12) / 8 + (m % 12 % 8) / 4 + (m % 4) / 2 + m % 2;
    int64_t r = 0, g = 0;
#define SHARE (pf ? pf + (g++) * k * PANEL / groups : NULL)
    for (; r + 12 <= m; r += 12) group12(x + r * k, k, panel, k, y + r * n + n0, n, ncols, b, SHARE, groups);
    for (; r + 8 <= m; r += 8) group8(x + r * k, k, panel, k, y + r * n + n0, n, ncols, b, SHARE, groups);
    for (; r + 4 <= m; r += 4) group4(x + r * k, k, panel, k, y + r * n + n0, n, ncols, b, SHARE, groups);
    for (; r + 2 <= m; r += 2) group2(x + r * k, k, panel, k, y + r * n + n0, n, ncols, b, SHARE, groups);
    for (; r < m; r++) group1(x + r * k, k, panel, k, y + r * n + n0, n, ncols, b, SHARE, groups);
#undef SHARE
}
#endif

#ifndef F32_AVX512
/* The portable kernel: per panel and row, 32 fp32 sums over k in order (fmaf: the
 * AVX-512 kernel's fused multiply-adds, one rounding each), then the bias. */
static void f32_portable(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                         float *y, int threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * PANEL;
        const int64_t n0 = p * PANEL, ncols = n - n0 < PANEL ? n - n0 : PANEL;
        for (int64_t r = 0; r < m; r++) {
            float acc[PANEL] = {0};
            for (int64_t kk = 0; kk < k; kk++) {
                const float xv = x[r * k + kk];
                for (int c = 0; c < PANEL; c++) acc[c] = fmaf(xv, panel[kk * PANEL + c], acc[c]);
            }
            for (int64_t c = 0; c < ncols; c++) y[r * n + n0 + c] = acc[c] + (bias ? bias[n0 + c] : 0.0f);
        }
    }
}
#endif

/* Whether the AVX-512 kernel is built (else parrot_f32_linear runs the portable C). */
int parrot_f32_linear_supported(void) {
#ifdef F32_AVX512
    return 1;
#else
    return 0;
#endif
}

/* See the top of the file: x [m, k] fp32 row-major, packed from parrot_f32_pack, bias
 * [n] or NULL, y [m, n].  Returns 0 (every build computes). */
int parrot_f32_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                      float *y, int threads) {
#ifdef F32_AVX512
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = panels * t / nt, hi = panels * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
            const int64_t rows = m - m0 < ROWS ? m - m0 : ROWS;
            for (int64_t p = lo; p < hi; p++) {
                const float *next = p + 1 < hi ? packed + (p + 1) * k * PANEL : NULL;
                panel_rows(x + m0 * k, rows, k, packed + p * k * PANEL, y + m0 * n, n, p * PANEL, bias, next);
            }
        }
    }
    return 0;
#else
    f32_portable(x, m, k, packed, n, bias, y, threads);
    return 0;
#endif
}
