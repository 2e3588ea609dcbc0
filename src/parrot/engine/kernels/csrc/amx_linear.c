/* y = x @ W^T (+ bias) with bf16 weights on Intel AMX tiles (CPU).
 *
 * At decode sizes (a few to a few dozen rows) a linear layer is a stream over its
 * weight: every weight element is used by only M rows.  oneDNN's AMX GEMM reaches
 * only about half of this machine's memory bandwidth there; this kernel streams
 * each weight block once per call from a layout made for it and keeps the tile
 * unit fed from cache.
 *
 * Packed weight layout (parrot_amx_pack): W [N, K] bf16 is padded with zeros to
 * Np = ceil(N / 32) * 32 rows and Kp = ceil(K / 32) * 32 columns and stored as
 * blocks [Np / 32][Kp / 32], each 16 rows of 64 bf16 (2 KiB, contiguous): block
 * (nb, kb) row r holds, at column c, W[nb * 32 + (c / 32) * 16 + (c % 32) / 2]
 * [kb * 32 + 2 r + c % 2].  The two 64-byte halves of its rows are the B tiles
 * (VNNI pairs along k) of output columns nb * 32 + [0, 16) and + [16, 32).
 *
 * Per call: x (fp32 or bf16, [M, K]) is rounded to bf16 once into a zero-padded
 * [ceil(M / 16) * 16, Kp] buffer (the A tiles); then, per chunk of up to ROWS rows,
 * threads take runs of 32-column blocks; for each block and each 32-row group,
 * four 16 x 16 fp32 accumulator tiles run over k.  Results (plus bias) are written
 * to y in x's dtype (bf16: round to nearest even).
 *
 * Invariants: rows >= M and columns >= N of the padding are never written; y is
 * fully written; the weight stays unchanged.  The AMX kernel is built where the
 * compiler targets AMX-BF16 and PARROT_PORTABLE is not defined; parrot_amx_ready()
 * also asks Linux for the tile state (ARCH_REQ_XCOMP_PERM) and says whether it may
 * run (the engine uses the kernel only then).  Everywhere else parrot_amx_linear
 * computes in portable C (below), so the layout and results are tested on every CPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parrot_ops.h"

static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The portable kernel: x rounded to bf16, each output one fp32 sum over k in order of
 * bf16 products (exact in fp32), then the bias; the weight read from the packed
 * blocks (the layout above).  The AMX tiles sum in another order: the results agree
 * up to fp32 rounding. */
static void amx_portable(const void *x, int x_bf16, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(PARROT_PORTABLE)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS 256 /* rows per chunk: its A tiles stay in L2 while the weight streams */

/* Tiles 0-3: accumulators (16 x 16 fp32); 4-5: A (16 rows x 32 bf16); 6-7: B
 * (configure_tiles, amx_tiles.h). */

/* One 16 x 16 accumulator tile (stored in `tile`) into y rows [m0, m0 + 16) and
 * columns [n0, n0 + 16), clipped to M x N, plus bias. */
static void write_tile(const float *tile, int64_t m0, int64_t n0, int64_t m, int64_t n, const float *bias,
                       void *y, int y_bf16) {
    const int64_t rows = m - m0 < 16 ? m - m0 : 16, cols = n - n0 < 16 ? n - n0 : 16;
    if (rows <= 0 || cols <= 0) return;
    const __mmask16 live = (__mmask16)((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(tile + r * 16), b);
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + r) * n + n0, live, (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + (m0 + r) * n + n0, live, v);
    }
}
#endif

int parrot_amx_ready(void) {
#ifdef HAVE_AMX
    static int state = -1; /* -1 unknown, 0 refused, 1 granted */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

/* Elements (uint16) of the packed copy of an [n, k] weight. */
int64_t parrot_amx_packed_size(int64_t n, int64_t k) {
    return ((n + 31) / 32 * 32) * ((k + 31) / 32 * 32);
}

/* w: [n, k] bf16 (as uint16), row-major; packed: parrot_amx_packed_size(n, k) elements. */
void parrot_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
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

/* See the top of the file.  Returns 0 on success (portable C where AMX is not
 * available), 2 when scratch memory could not be allocated (nothing written). */
int parrot_amx_linear(const void *x, int x_bf16, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                      const float *bias, void *y, int threads) {
#ifdef HAVE_AMX
    if (!parrot_amx_ready()) {
        amx_portable(x, x_bf16, m, k, packed, n, bias, y, threads);
        return 0;
    }
    const int64_t kp = (k + 31) / 32 * 32, mp = (m + 15) / 16 * 16, kb_count = kp / 32, nb_count = (n + 31) / 32;
    uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * (size_t)(mp * kp));
    if (!a) return 2;
#pragma omp parallel num_threads(threads)
    {
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
                    write_tile(tile, g, nb * 32, m, n, bias, y, x_bf16);
                    _tile_stored(1, tile, 64);
                    write_tile(tile, g, nb * 32 + 16, m, n, bias, y, x_bf16);
                    if (two) {
                        _tile_stored(2, tile, 64);
                        write_tile(tile, g + 16, nb * 32, m, n, bias, y, x_bf16);
                        _tile_stored(3, tile, 64);
                        write_tile(tile, g + 16, nb * 32 + 16, m, n, bias, y, x_bf16);
                    }
                }
            }
        }
        _tile_release();
    }
    free(a);
    return 0;
#else
    amx_portable(x, x_bf16, m, k, packed, n, bias, y, threads);
    return 0;
#endif
}
