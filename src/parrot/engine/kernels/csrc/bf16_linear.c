/* y = x @ W^T (+ bias) with bf16 weights at decode sizes (CPU), on one packed layout
 * read by three backends: Intel AMX tiles, AVX-512 BF16 dot products (vdpbf16ps: AMD
 * Zen 4 and later, Intel since Cooper Lake) and portable C.
 *
 * At decode sizes (a few to a few dozen rows) a linear layer is a stream over its
 * weight: every weight element is used by only M rows.  oneDNN's bf16 GEMM reaches
 * only about half of the memory bandwidth there (AMX and AVX-512 BF16 alike); these
 * kernels stream each weight block once per call from a layout made for them and keep
 * the dot-product unit fed from cache.
 *
 * Packed weight layout (parrot_bf16_pack): W [N, K] bf16 is padded with zeros to
 * Np = ceil(N / 32) * 32 rows and Kp = ceil(K / 32) * 32 columns and stored as
 * blocks [Np / 32][Kp / 32], each 16 rows of 64 bf16 (2 KiB, contiguous): block
 * (nb, kb) row r holds, at column c, W[nb * 32 + (c / 32) * 16 + (c % 32) / 2]
 * [kb * 32 + 2 r + c % 2].  The two 64-byte halves of its rows hold output columns
 * nb * 32 + [0, 16) and + [16, 32) as pairs along k (the "VNNI" pairs): they are the
 * AMX B tiles, and, row by row, the weight operands of vdpbf16ps for those 16 columns.
 *
 * Per call: x (fp32 or bf16, [M, K]) is rounded to bf16 once into a zero-padded
 * buffer with rows Kp long; then threads take runs of 32-column blocks.
 *   AMX: per chunk of up to ROWS rows, for each block and each 32-row group, four
 *   16 x 16 fp32 accumulator tiles run over k.
 *   AVX-512 BF16: for each block and each group of up to 12 rows, two fp32 vectors a
 *   row run over k, each k pair of a row broadcast against the block row's two halves;
 *   a block's weights are read from memory once (the first group) and from cache for
 *   the rest.
 * Results (plus bias) are written to y in x's dtype (bf16: round to nearest even).
 *
 * Invariants: rows >= M and columns >= N of the padding are never written; y is fully
 * written; the weight stays unchanged; every backend forms the same bf16 products and
 * sums them in fp32 (in its own order: they agree up to fp32 rounding).  The AMX
 * kernel is built where the compiler targets AMX-BF16, the AVX-512 BF16 one where it
 * targets AVX512-BF16, neither with PARROT_PORTABLE; parrot_bf16_linear_best() says
 * which of them may run (AMX also needs Linux to grant the tile state).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_scalar.h"
#include "parrot_ops.h"

/* The portable kernel: x rounded to bf16, each output one fp32 sum over k in order of
 * bf16 products (exact in fp32), then the bias; the weight read from the packed
 * blocks (the layout above).  The other backends sum in other orders: the results
 * agree up to fp32 rounding. */
static void bf16_portable(const void *x, int x_bf16, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                         const float *bias, void *y, int threads) {
    const int64_t kb_count = (k + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t col = 0; col < n; col++) {
        const uint16_t *blocks = packed + (col / 32) * kb_count * 1024;
        const int64_t lane = (col % 32) / 16 * 32 + (col % 16) * 2; /* its column pair in a block row */
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) {
                const uint16_t w = blocks[(kk / 32) * 1024 + (kk % 32) / 2 * 64 + lane + kk % 2];
                const uint16_t xb =
                    x_bf16 ? ((const uint16_t *)x)[r * k + kk] : bf16_round(((const float *)x)[r * k + kk]);
                acc += bf16_value(xb) * bf16_value(w);
            }
            const float out = acc + (bias ? bias[col] : 0.0f);
            if (x_bf16)
                ((uint16_t *)y)[r * n + col] = bf16_round(out);
            else
                ((float *)y)[r * n + col] = out;
        }
    }
}

#if defined(__AVX512BF16__) && !defined(PARROT_PORTABLE)
#define HAVE_DP 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif
#endif

enum { BACKEND_PORTABLE = 0, BACKEND_DP = 1, BACKEND_AMX = 2 };

#ifdef HAVE_DP
/* Rows [0, mp) of the rounded input: x's rows rounded to bf16, padded with zeros to
 * kp columns, rows >= m all zeros.  Runs as an omp for inside the caller's parallel
 * region (its implied barrier ends it). */
static void round_rows(const void *x, int x_bf16, int64_t m, int64_t k, int64_t mp, int64_t kp, uint16_t *a) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < mp; r++) {
        uint16_t *dst = a + r * kp;
        if (r >= m) {
            memset(dst, 0, sizeof(uint16_t) * kp);
            continue;
        }
        int64_t c = 0;
        if (x_bf16) {
            memcpy(dst, (const uint16_t *)x + r * k, sizeof(uint16_t) * k);
            c = k;
        } else {
            const float *src = (const float *)x + r * k;
            for (; c + 16 <= k; c += 16)
                _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c)));
            for (; c < k; c++) dst[c] = bf16_round(src[c]);
        }
        for (; c < kp; c++) dst[c] = 0;
    }
}

/* Sixteen outputs v (+ the bias b) into y's row `row` at columns [n0, n0 + 16), the
 * lanes of `live` only, in fp32 or (y_bf16) rounded to bf16. */
static inline void store16(void *y, int y_bf16, int64_t row, int64_t n, int64_t n0, __mmask16 live, __m512 v,
                           __m512 b) {
    v = _mm512_add_ps(v, b);
    if (y_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)y + row * n + n0, live, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)y + row * n + n0, live, v);
}

/* The lanes of columns [n0, n0 + 16) that lie below n. */
static inline __mmask16 live_lanes(int64_t n0, int64_t n) {
    const int64_t cols = n - n0;
    return cols >= 16 ? (__mmask16)0xffff : cols <= 0 ? (__mmask16)0 : (__mmask16)((1u << cols) - 1u);
}

/* AVX-512 BF16: MR rows of the rounded input (a, rows kp apart) times the 32 output
 * columns of one block run (wb: its kb_count blocks), into y rows [row0, row0 + MR). */
#define DEFINE_DP_GROUP(MR)                                                                                        \
    static inline __attribute__((always_inline)) void dp_group##MR(const uint16_t *a, int64_t kp,                 \
                                                                   const uint16_t *wb, int64_t kb_count, void *y,  \
                                                                   int y_bf16, int64_t row0, int64_t n,           \
                                                                   int64_t n0, const float *bias) {               \
        __m512 lo[MR], hi[MR];                                                                                     \
        for (int i = 0; i < MR; i++) lo[i] = hi[i] = _mm512_setzero_ps();                                          \
        for (int64_t kb = 0; kb < kb_count; kb++) {                                                                \
            const uint16_t *blk = wb + kb * 1024, *ak = a + kb * 32;                                               \
            for (int r = 0; r < 16; r++) {                                                                         \
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(blk + r * 64);                                   \
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(blk + r * 64 + 32);                              \
                for (int i = 0; i < MR; i++) {                                                                     \
                    int32_t pair;                                                                                  \
                    memcpy(&pair, ak + i * kp + 2 * r, sizeof pair);                                               \
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                         \
                    lo[i] = _mm512_dpbf16_ps(lo[i], xb, w0);                                                       \
                    hi[i] = _mm512_dpbf16_ps(hi[i], xb, w1);                                                       \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        const __mmask16 m0 = live_lanes(n0, n), m1 = live_lanes(n0 + 16, n);                                       \
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + n0) : _mm512_setzero_ps();                       \
        const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + n0 + 16) : _mm512_setzero_ps();                  \
        for (int i = 0; i < MR; i++) {                                                                             \
            store16(y, y_bf16, row0 + i, n, n0, m0, lo[i], b0);                                                    \
            store16(y, y_bf16, row0 + i, n, n0 + 16, m1, hi[i], b1);                                               \
        }                                                                                                          \
    }
DEFINE_DP_GROUP(12)
DEFINE_DP_GROUP(8)
DEFINE_DP_GROUP(4)
DEFINE_DP_GROUP(2)
DEFINE_DP_GROUP(1)

/* AVX-512 BF16 over every block run (an omp for inside the caller's parallel region):
 * each thread's runs in order, all rows of a run in groups of 12, 8, 4, 2 and 1. */
static void dp_blocks(const uint16_t *a, int64_t m, int64_t kp, const uint16_t *packed, int64_t n,
                      const float *bias, void *y, int y_bf16) {
    const int64_t kb_count = kp / 32, nb_count = (n + 31) / 32;
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nb_count; nb++) {
        const uint16_t *wb = packed + nb * kb_count * 1024;
        const int64_t n0 = nb * 32;
        int64_t r = 0;
        for (; r + 12 <= m; r += 12) dp_group12(a + r * kp, kp, wb, kb_count, y, y_bf16, r, n, n0, bias);
        for (; r + 8 <= m; r += 8) dp_group8(a + r * kp, kp, wb, kb_count, y, y_bf16, r, n, n0, bias);
        for (; r + 4 <= m; r += 4) dp_group4(a + r * kp, kp, wb, kb_count, y, y_bf16, r, n, n0, bias);
        for (; r + 2 <= m; r += 2) dp_group2(a + r * kp, kp, wb, kb_count, y, y_bf16, r, n, n0, bias);
        for (; r < m; r++) dp_group1(a + r * kp, kp, wb, kb_count, y, y_bf16, r, n, n0, bias);
    }
}
#endif

#ifdef HAVE_AMX
#define ROWS 256 /* AMX: rows per chunk; its A tiles stay in L2 while the weight streams */

/* Tiles 0-3: accumulators (16 x 16 fp32); 4-5: A (16 rows x 32 bf16); 6-7: B
 * (configure_tiles, amx_tiles.h). */

/* One 16 x 16 accumulator tile (stored in `tile`) into y rows [m0, m0 + 16) and
 * columns [n0, n0 + 16), clipped to M x N, plus bias. */
static void write_tile(const float *tile, int64_t m0, int64_t n0, int64_t m, int64_t n, const float *bias,
                       void *y, int y_bf16) {
    const int64_t rows = m - m0 < 16 ? m - m0 : 16;
    const __mmask16 live = live_lanes(n0, n);
    if (rows <= 0 || !live) return;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) store16(y, y_bf16, m0 + r, n, n0, live, _mm512_load_ps(tile + r * 16), b);
}

/* AMX over every block run (inside the caller's parallel region); a: mp rows. */
static void amx_blocks(const uint16_t *a, int64_t m, int64_t mp, int64_t kp, const uint16_t *packed, int64_t n,
                       const float *bias, void *y, int y_bf16) {
    const int64_t kb_count = kp / 32, nb_count = (n + 31) / 32;
    configure_tiles();
    float tile[256] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < mp; m0 += ROWS) {
        const int64_t m1 = m0 + ROWS < mp ? m0 + ROWS : mp;
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nb_count; nb++) {
            const uint16_t *wb = packed + nb * kb_count * 1024;
            for (int64_t g = m0; g < m1; g += 32) {
                const int two = g + 16 < m1; /* a second 16-row A tile in this group */
                const uint16_t *a0 = a + g * kp, *a1 = a + (g + 16) * kp;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < kb_count; kb++) {
                    const uint16_t *blk = wb + kb * 1024;
                    _tile_loadd(6, blk, 128);
                    _tile_loadd(7, blk + 32, 128);
                    _tile_loadd(4, a0 + kb * 32, kp * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a1 + kb * 32, kp * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, tile, 64);
                write_tile(tile, g, nb * 32, m, n, bias, y, y_bf16);
                _tile_stored(1, tile, 64);
                write_tile(tile, g, nb * 32 + 16, m, n, bias, y, y_bf16);
                if (two) {
                    _tile_stored(2, tile, 64);
                    write_tile(tile, g + 16, nb * 32, m, n, bias, y, y_bf16);
                    _tile_stored(3, tile, 64);
                    write_tile(tile, g + 16, nb * 32 + 16, m, n, bias, y, y_bf16);
                }
            }
        }
    }
    _tile_release();
}
#endif

/* The fastest backend that may run here: 2 AMX tiles (built, and Linux granted the
 * tile state), 1 AVX-512 BF16 (built), 0 portable C only. */
int parrot_bf16_linear_best(void) {
#ifdef HAVE_AMX
    static int granted = -1; /* -1 unknown, 0 refused, 1 granted */
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    if (granted) return BACKEND_AMX;
#endif
#ifdef HAVE_DP
    return BACKEND_DP;
#else
    return BACKEND_PORTABLE;
#endif
}

/* Elements (uint16) of the packed copy of an [n, k] weight. */
int64_t parrot_bf16_packed_size(int64_t n, int64_t k) {
    return ((n + 31) / 32 * 32) * ((k + 31) / 32 * 32);
}

/* w: [n, k] bf16 (as uint16), row-major; packed: parrot_bf16_packed_size(n, k) elements. */
void parrot_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t kb_count = (k + 31) / 32, nb_count = (n + 31) / 32;
    for (int64_t nb = 0; nb < nb_count; nb++)
        for (int64_t kb = 0; kb < kb_count; kb++) {
            uint16_t *block = packed + (nb * kb_count + kb) * 1024;
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < 64; c++) {
                    const int64_t col = nb * 32 + (c / 32) * 16 + (c % 32) / 2, kk = kb * 32 + 2 * r + c % 2;
                    block[r * 64 + c] = col < n && kk < k ? w[col * k + kk] : 0;
                }
        }
}

/* See the top of the file; `backend` as parrot_bf16_linear_best() numbers them.
 * Returns 0 on success; 1 when `backend` cannot run here (above the best one; nothing
 * written); 2 when scratch memory could not be allocated (nothing written). */
int parrot_bf16_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                       const float *bias, void *y, int backend, int threads) {
    if (backend < BACKEND_PORTABLE || backend > parrot_bf16_linear_best()) return 1;
    if (backend == BACKEND_PORTABLE || m == 0) {
        bf16_portable(x, x_bf16, m, k, packed, n, bias, y, threads);
        return 0;
    }
#ifdef HAVE_DP
    const int64_t kp = (k + 31) / 32 * 32, mp = backend == BACKEND_AMX ? (m + 15) / 16 * 16 : m;
    uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * (size_t)(mp * kp));
    if (!a) return 2;
#pragma omp parallel num_threads(threads)
    {
        round_rows(x, x_bf16, m, k, mp, kp, a);
#ifdef HAVE_AMX
        if (backend == BACKEND_AMX)
            amx_blocks(a, m, mp, kp, packed, n, bias, y, x_bf16);
        else
#endif
            dp_blocks(a, m, kp, packed, n, bias, y, x_bf16);
    }
    free(a);
#endif
    return 0;
}
