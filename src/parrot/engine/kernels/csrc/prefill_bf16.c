/* Causal attention of prefill chunks over the paged bf16 KV cache, in bf16 dot products:
 * on Intel AMX tiles, or in AVX-512 BF16 (vdpbf16ps: AMD Zen 4 and later, Intel Cooper
 * Lake and later).
 *
 * A prompt's attention is small next to its projections in FLOPs, but PyTorch's CPU
 * flash kernel computes it at a fraction of what the CPU's bf16 dot products do (60-100
 * GFLOP/s on a 2-core AMD EPYC), so it took about a quarter to a third of a prefill
 * step.  This kernel computes the two products (scores and the weighted sum of values)
 * in bf16 dot products and the softmax in AVX-512, reading the keys and values from the
 * paged cache in place of a gathered copy.
 *
 * Chunk c has n[c] queries, rows q_row[c] .. + n[c] of q ([T, H, D] fp32, rows q_stride
 * floats apart, H = KVH * G, head h reading kv head h / G), at absolute positions
 * start[c] ..; its keys are positions [0, start[c] + n[c]) of its sequence, in the
 * cache blocks blocks[blk_off[c] ..] (block b holds positions [b * BS, (b + 1) * BS));
 * k and v are one layer's cache, [NB, BS, KVH, D] bf16.  Query i attends to the keys
 * at positions <= start[c] + i.  out rows are written like q's (fp32, out_stride).
 *
 * First, the keys and values of every chunk and kv head are copied once into the
 * layouts of the dot products (VNNI pairs: kp for the scores' B operand, pairs along the
 * head dimension; vp for the values', pairs along the keys), zero past the last key,
 * 32 keys a work item.  A 64-byte row of either is 16 outputs x one pair: an AMX B-tile
 * row, and one vdpbf16ps operand.  Then each (chunk, head, block of 16 queries) is one
 * work item, the blocks with the most keys first:
 *   1. the queries, rounded to bf16, in a zero-padded [16, D] buffer (the A operand);
 *   2. scores S = Q K^T for every 16 keys up to the block's last query (AMX: one
 *      16 x 16 fp32 tile over D / 32 tile products; AVX-512 BF16: one vector of 16
 *      keys per query row, each query's pair of dims broadcast against the keys' pair
 *      row), stored in a [16, keys] buffer;
 *   3. per row: the maximum of the scaled scores over its visible keys, then
 *      p = exp(scale * s - max) (0 for keys it may not see), their fp32 sum, and p
 *      rounded to bf16 into a [16, keys] buffer;
 *   4. O = P V over 32 keys a step (AMX: up to four 16 x 16 fp32 output tiles at a
 *      time; AVX-512 BF16: 16 output columns of all 16 rows at a time, each row's pair
 *      of probabilities broadcast against the values' pair row), then out = O / sum.
 * So every query's result is its softmax-weighted sum of values, like PyTorch's bf16
 * flash attention: products of bf16 values accumulated in fp32, the probabilities
 * rounded to bf16 before the second product (each backend sums in its own order:
 * results agree with other kernels up to that rounding).
 *
 * Backends (parrot_prefill_bf16_best numbers them): 2 AMX, built where the compiler
 * targets AMX-BF16 and run only when Linux grants the tile state; 1 AVX-512 BF16, built
 * where the compiler targets AVX512-BF16; 0 portable C (one query at a time, every
 * build: the tests run it).  The fast backends take head dims that are multiples of 32.
 *
 * Invariants: the cache and q are never written; every out row of every chunk is
 * fully written (D columns of each head), nothing else of out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_scalar.h"
#include "parrot_ops.h"

/* The cache row (bf16 elements from the layer's start) of kv head `kvh` at key
 * position `pos` of a chunk whose blocks are `blocks`. */
static inline int64_t cache_at(const int64_t *blocks, int64_t pos, int64_t bs, int64_t kv_heads, int64_t kvh,
                               int64_t dim) {
    return ((blocks[pos / bs] * bs + pos % bs) * kv_heads + kvh) * dim;
}

/* The portable kernel: the same quantities in plain C, one (chunk, head, query) at a
 * time. */
static int prefill_portable(const float *q, int64_t q_stride, const int64_t *q_row, const int64_t *n,
                            const int64_t *start, int64_t chunks, const uint16_t *k, const uint16_t *v,
                            const int64_t *blocks, const int64_t *blk_off, int64_t bs, int64_t kv_heads,
                            int64_t group, int64_t dim, float scale, float *out, int64_t out_stride,
                            int threads) {
    int64_t most = 0;
    for (int64_t c = 0; c < chunks; c++)
        if (start[c] + n[c] > most) most = start[c] + n[c];
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *p = malloc(sizeof(float) * (size_t)(most > 0 ? most : 1));
        float *qb = malloc(sizeof(float) * (size_t)dim);
        float *acc = malloc(sizeof(float) * (size_t)dim);
        const int ok = p && qb && acc;
        if (!ok) failed = 1;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t heads = kv_heads * group, *blk = blocks + blk_off[c];
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < heads * n[c]; item++) {
                if (!ok) continue;
                const int64_t h = item / n[c], i = item % n[c], kvh = h / group, seen = start[c] + i + 1;
                const float *qi = q + (q_row[c] + i) * q_stride + h * dim;
                for (int64_t d = 0; d < dim; d++) qb[d] = bf16_value(bf16_round(qi[d]));
                float most_score = -INFINITY;
                for (int64_t j = 0; j < seen; j++) {
                    const uint16_t *kj = k + cache_at(blk, j, bs, kv_heads, kvh, dim);
                    float s = 0.0f;
                    for (int64_t d = 0; d < dim; d++) s += qb[d] * bf16_value(kj[d]);
                    p[j] = s * scale;
                    if (p[j] > most_score) most_score = p[j];
                }
                float sum = 0.0f;
                for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
                for (int64_t j = 0; j < seen; j++) {
                    const float e = expf(p[j] - most_score);
                    sum += e;
                    const float w = bf16_value(bf16_round(e));
                    const uint16_t *vj = v + cache_at(blk, j, bs, kv_heads, kvh, dim);
                    for (int64_t d = 0; d < dim; d++) acc[d] += w * bf16_value(vj[d]);
                }
                float *o = out + (q_row[c] + i) * out_stride + h * dim;
                for (int64_t d = 0; d < dim; d++) o[d] = acc[d] / sum;
            }
        }
        free(p);
        free(qb);
        free(acc);
    }
    return failed ? 2 : 0;
}

#if defined(__AVX512BF16__) && !defined(PARROT_PORTABLE)
#define HAVE_DP 1
#include "simd.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include "amx_tiles.h"
#endif
#endif

enum { BACKEND_PORTABLE = 0, BACKEND_DP = 1, BACKEND_AMX = 2 };

#ifdef HAVE_DP
/* Copy 32-key step `step` of a chunk's keys [0, total) of kv head kvh into kp (the
 * scores' B operand: [ceil(total / 16)][dim / 32][16 pair rows][16 keys x 2]) and its
 * values into vp (P V's B operand: [ceil(total / 32)][dim / 16][16 key-pair rows]
 * [16 columns x 2]), zero past the last key. */
static void pack_step(const uint16_t *k, const uint16_t *v, const int64_t *blk, int64_t total, int64_t step,
                      int64_t bs, int64_t kv_heads, int64_t kvh, int64_t dim, uint16_t *kp, uint16_t *vp) {
    const int64_t dsteps = dim / 32, tcols = dim / 16;
    for (int64_t half = 0; half < 2; half++) { /* keys: two 16-key blocks per step */
        const int64_t kb = step * 2 + half;
        uint16_t *dst = kp + kb * dsteps * 512;
        for (int64_t j = 0; j < 16; j++) {
            const int64_t pos = kb * 16 + j;
            if (pos >= total) {
                for (int64_t ds = 0; ds < dsteps; ds++)
                    for (int64_t r = 0; r < 16; r++) {
                        dst[ds * 512 + r * 32 + j * 2] = 0;
                        dst[ds * 512 + r * 32 + j * 2 + 1] = 0;
                    }
                continue;
            }
            const uint16_t *src = k + cache_at(blk, pos, bs, kv_heads, kvh, dim);
            for (int64_t ds = 0; ds < dsteps; ds++) /* key j's dims (2r, 2r + 1) at row r */
                for (int64_t r = 0; r < 16; r++)
                    memcpy(dst + ds * 512 + r * 32 + j * 2, src + ds * 32 + 2 * r, 2 * sizeof(uint16_t));
        }
    }
    uint16_t *dst = vp + step * tcols * 512; /* values: key pairs (2r, 2r + 1) of this step */
    for (int64_t r = 0; r < 16; r++) {
        const int64_t p0 = step * 32 + 2 * r, p1 = p0 + 1;
        const uint16_t *v0 = p0 < total ? v + cache_at(blk, p0, bs, kv_heads, kvh, dim) : NULL;
        const uint16_t *v1 = p1 < total ? v + cache_at(blk, p1, bs, kv_heads, kvh, dim) : NULL;
        for (int64_t t = 0; t < tcols; t++)
            for (int64_t j = 0; j < 16; j++) {
                dst[t * 512 + r * 32 + j * 2] = v0 ? v0[t * 16 + j] : 0;
                dst[t * 512 + r * 32 + j * 2 + 1] = v1 ? v1[t * 16 + j] : 0;
            }
    }
}

/* Step 1: the block's `rows` queries of head h, rounded to bf16, into qa [16, dim]
 * (zero rows past `rows`). */
static void round_queries(const float *q, int64_t q_stride, int64_t row0, int64_t rows, int64_t h, int64_t dim,
                          uint16_t *qa) {
    for (int64_t r = 0; r < 16; r++) {
        uint16_t *dst = qa + r * dim;
        if (r >= rows) {
            memset(dst, 0, sizeof(uint16_t) * (size_t)dim);
            continue;
        }
        const float *src = q + (row0 + r) * q_stride + h * dim;
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
    }
}

/* Step 3: per row r of s [16, stride] (scores), the softmax numerators of the keys it
 * sees (first_seen + r of them; padding rows past `rows` see one), rounded to bf16 into
 * pa [16, stride] over `keys` columns (zero past what a row sees), and their sums. */
static void softmax_rows(const float *s, uint16_t *pa, int64_t stride, int64_t rows, int64_t first_seen,
                         int64_t keys, float scale, float *sums) {
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < 16; r++) {
        const int64_t visible = r < rows ? first_seen + r : 1; /* padding rows: any finite row */
        const float *sr = s + r * stride;
        uint16_t *pr = pa + r * stride;
        __m512 vmax = ninf;
        for (int64_t j = 0; j < visible; j += 16) {
            const int64_t left = visible - j;
            const __mmask16 live = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sr + j), vscale);
            vmax = _mm512_mask_max_ps(vmax, live, vmax, x);
        }
        const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j += 16) {
            const int64_t left = visible - j;
            const __mmask16 live = left >= 16 ? (__mmask16)0xffff
                                   : left <= 0 ? (__mmask16)0
                                               : (__mmask16)((1u << left) - 1u);
            __m512 e = _mm512_setzero_ps();
            if (live) {
                const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, sr + j), vscale, vm);
                e = _mm512_maskz_mov_ps(live, exp512(_mm512_mask_blend_ps(live, _mm512_setzero_ps(), x)));
            }
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sums[r] = _mm512_reduce_add_ps(vsum);
    }
}

/* The pair of bf16 at p, broadcast to every 32-bit lane (a vdpbf16ps A operand). */
static inline __m512bh pair_bcast(const uint16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* AVX-512 BF16, step 2: scores of the 16 query rows of qa against 16-key blocks
 * [0, kblocks) of kp, into s (rows `stride` floats apart). */
static void scores_dp(const uint16_t *qa, const uint16_t *kp, int64_t kblocks, int64_t dim, float *s,
                      int64_t stride) {
    const int64_t dsteps = dim / 32;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t ds = 0; ds < dsteps; ds++) {
            const uint16_t *krows = kp + (kb * dsteps + ds) * 512;
            for (int64_t pr = 0; pr < 16; pr++) { /* dims (2 pr, 2 pr + 1) of this step */
                const __m512bh kk = (__m512bh)_mm512_loadu_si512(krows + pr * 32);
                const uint16_t *qcol = qa + ds * 32 + 2 * pr;
                for (int r = 0; r < 16; r++) acc[r] = _mm512_dpbf16_ps(acc[r], pair_bcast(qcol + r * dim), kk);
            }
        }
        for (int r = 0; r < 16; r++) _mm512_storeu_ps(s + r * stride + kb * 16, acc[r]);
    }
}

/* AVX-512 BF16, step 4: O = P V for the block's 16 rows over 32-key steps [0, ksteps)
 * of vp, 16 output columns at a time, divided by the rows' sums into out. */
static void values_dp(const uint16_t *pa, const uint16_t *vp, int64_t ksteps, int64_t dim, int64_t stride,
                      const float *sums, int64_t rows, float *out, int64_t out_stride) {
    const int64_t tcols = dim / 16;
    for (int64_t t = 0; t < tcols; t++) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t ks = 0; ks < ksteps; ks++) {
            const uint16_t *vrows = vp + (ks * tcols + t) * 512;
            for (int64_t pr = 0; pr < 16; pr++) { /* keys (2 pr, 2 pr + 1) of this step */
                const __m512bh vv = (__m512bh)_mm512_loadu_si512(vrows + pr * 32);
                const uint16_t *pcol = pa + ks * 32 + 2 * pr;
                for (int r = 0; r < 16; r++) acc[r] = _mm512_dpbf16_ps(acc[r], pair_bcast(pcol + r * stride), vv);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            _mm512_storeu_ps(out + r * out_stride + t * 16, _mm512_div_ps(acc[r], _mm512_set1_ps(sums[r])));
    }
}

#ifdef HAVE_AMX
/* Tiles 0-3: output accumulators; 4: a score tile; 5: A (queries or probabilities);
 * 6: B (keys or values) (configure_tiles, amx_tiles.h). */

/* AMX, step 2 (as scores_dp). */
static void scores_amx(const uint16_t *qa, const uint16_t *kp, int64_t kblocks, int64_t dim, float *s,
                       int64_t stride) {
    const int64_t dsteps = dim / 32;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_zero(4);
        for (int64_t ds = 0; ds < dsteps; ds++) {
            _tile_loadd(5, qa + ds * 32, dim * 2);
            _tile_loadd(6, kp + (kb * dsteps + ds) * 512, 64);
            _tile_dpbf16ps(4, 5, 6);
        }
        _tile_stored(4, s + kb * 16, stride * 4);
    }
}

/* AMX, step 4 (as values_dp); o [16, 16] fp32 scratch. */
static void values_amx(const uint16_t *pa, const uint16_t *vp, int64_t ksteps, int64_t dim, int64_t stride,
                       const float *sums, int64_t rows, float *out, int64_t out_stride, float *o) {
    const int64_t tcols = dim / 16;
    for (int64_t t0 = 0; t0 < tcols; t0 += 4) { /* up to 64 columns at a time */
        const int64_t tiles = tcols - t0 < 4 ? tcols - t0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            const uint16_t *vstep = vp + ks * tcols * 512;
            _tile_loadd(5, pa + ks * 32, stride * 2);
            _tile_loadd(6, vstep + t0 * 512, 64);
            _tile_dpbf16ps(0, 5, 6);
            if (tiles > 1) {
                _tile_loadd(6, vstep + (t0 + 1) * 512, 64);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (tiles > 2) {
                _tile_loadd(6, vstep + (t0 + 2) * 512, 64);
                _tile_dpbf16ps(2, 5, 6);
            }
            if (tiles > 3) {
                _tile_loadd(6, vstep + (t0 + 3) * 512, 64);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        for (int64_t t = 0; t < tiles; t++) {
            switch (t) { /* tile numbers must be constants */
            case 0: _tile_stored(0, o, 64); break;
            case 1: _tile_stored(1, o, 64); break;
            case 2: _tile_stored(2, o, 64); break;
            default: _tile_stored(3, o, 64); break;
            }
            for (int64_t r = 0; r < rows; r++)
                _mm512_storeu_ps(out + r * out_stride + (t0 + t) * 16,
                                 _mm512_div_ps(_mm512_load_ps(o + r * 16), _mm512_set1_ps(sums[r])));
        }
    }
}
#endif

/* One work item: head h's queries [i0, i0 + rows) of a chunk starting at `start`
 * (see the top of the file), on `backend`.  qa [16, dim] bf16, s [16, stride] fp32, pa
 * [16, stride] bf16, o [16, 16] fp32: the thread's scratch; stride: a multiple of 32
 * >= the keys. */
static void attend_block(const float *q, int64_t q_stride, int64_t q_row0, int64_t i0, int64_t rows,
                         int64_t start, int64_t h, int64_t dim, float scale, const uint16_t *kp,
                         const uint16_t *vp, float *out, int64_t out_stride, uint16_t *qa, float *s,
                         uint16_t *pa, float *o, int64_t stride, int backend) {
    const int64_t seen = start + i0 + rows; /* keys the block's last query sees */
    const int64_t kblocks = (seen + 15) / 16, ksteps = (seen + 31) / 32;
    float *dst = out + (q_row0 + i0) * out_stride + h * dim;
    float sums[16];
    round_queries(q, q_stride, q_row0 + i0, rows, h, dim, qa);
#ifdef HAVE_AMX
    if (backend == BACKEND_AMX) {
        scores_amx(qa, kp, kblocks, dim, s, stride);
        softmax_rows(s, pa, stride, rows, start + i0 + 1, ksteps * 32, scale, sums);
        values_amx(pa, vp, ksteps, dim, stride, sums, rows, dst, out_stride, o);
        return;
    }
#endif
    (void)o;
    (void)backend;
    scores_dp(qa, kp, kblocks, dim, s, stride);
    softmax_rows(s, pa, stride, rows, start + i0 + 1, ksteps * 32, scale, sums);
    values_dp(pa, vp, ksteps, dim, stride, sums, rows, dst, out_stride);
}

/* The fast backends' pass over every chunk (see the top of the file): pack, then attend
 * block by block.  Returns 0, or 2 when scratch memory could not be allocated. */
static int prefill_fast(const float *q, int64_t q_stride, const int64_t *q_row, const int64_t *n,
                        const int64_t *start, int64_t chunks, const uint16_t *k, const uint16_t *v,
                        const int64_t *blocks, const int64_t *blk_off, int64_t block_size, int64_t kv_heads,
                        int64_t group, int64_t dim, float scale, float *out, int64_t out_stride, int backend,
                        int threads) {
    /* Every chunk's packed keys and values side by side: chunk c's kv head h at
     * packed_at[c] + h * its (padded keys) * dim; the work lists of both passes. */
    const int64_t heads = kv_heads * group;
    int64_t most = 0, packed = 0, steps = 0, items = 0;
    int64_t *packed_at = malloc(sizeof(int64_t) * (size_t)(3 * chunks + 2));
    if (!packed_at) return 2;
    int64_t *step_at = packed_at + chunks, *item_at = step_at + chunks + 1;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t total = start[c] + n[c], padded = (total + 31) / 32 * 32;
        if (total > most) most = total;
        packed_at[c] = packed;
        packed += padded * dim * kv_heads;
        step_at[c] = steps;
        steps += padded / 32 * kv_heads;
        item_at[c] = items;
        items += (n[c] + 15) / 16 * heads;
    }
    step_at[chunks] = steps;
    item_at[chunks] = items;
    const int64_t stride = (most + 31) / 32 * 32; /* the scratch rows' keys, whole 32-key steps */
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * (size_t)packed);
    uint16_t *vp = aligned_alloc(64, sizeof(uint16_t) * (size_t)packed);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        free(packed_at);
        return 2;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint16_t *qa = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * dim));
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(16 * stride));
        uint16_t *pa = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * stride));
        float *o = aligned_alloc(64, sizeof(float) * 256);
        const int ok = qa && s && pa && o;
        if (!ok) failed = 1;
        int64_t c = 0;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < steps; w++) {
            while (step_at[c + 1] <= w) c++;
            while (step_at[c] > w) c--;
            const int64_t total = start[c] + n[c], per_head = (total + 31) / 32, local = w - step_at[c];
            const int64_t kvh = local / per_head, at = packed_at[c] + kvh * per_head * 32 * dim;
            pack_step(k, v, blocks + blk_off[c], total, local % per_head, block_size, kv_heads, kvh, dim, kp + at,
                      vp + at);
        }
#ifdef HAVE_AMX
        if (backend == BACKEND_AMX) configure_tiles();
#endif
        c = 0;
#pragma omp for schedule(dynamic)
        for (int64_t w = 0; w < items; w++) {
            if (!ok) continue;
            while (item_at[c + 1] <= w) c++;
            while (item_at[c] > w) c--;
            const int64_t qblocks = (n[c] + 15) / 16, local = w - item_at[c];
            const int64_t qb = qblocks - 1 - local / heads, h = local % heads; /* longest rows first */
            const int64_t i0 = qb * 16, rows = n[c] - i0 < 16 ? n[c] - i0 : 16, kvh = h / group;
            const int64_t per_head = (start[c] + n[c] + 31) / 32 * 32 * dim, at = packed_at[c] + kvh * per_head;
            attend_block(q, q_stride, q_row[c], i0, rows, start[c], h, dim, scale, kp + at, vp + at, out,
                         out_stride, qa, s, pa, o, stride, backend);
        }
#ifdef HAVE_AMX
        if (backend == BACKEND_AMX) _tile_release();
#endif
        free(qa);
        free(s);
        free(pa);
        free(o);
    }
    free(kp);
    free(vp);
    free(packed_at);
    return failed ? 2 : 0;
}
#endif

/* The fastest backend that may run heads of `dim` here: 2 AMX (built, tiles granted),
 * 1 AVX-512 BF16 (built), both for dim % 32 == 0; else 0 portable C. */
int parrot_prefill_bf16_best(int64_t dim) {
    if (dim <= 0 || dim % 32) return BACKEND_PORTABLE;
#ifdef HAVE_AMX
    if (parrot_bf16_linear_best() == BACKEND_AMX) return BACKEND_AMX; /* the same tile grant */
#endif
#ifdef HAVE_DP
    return BACKEND_DP;
#else
    return BACKEND_PORTABLE;
#endif
}

/* See the top of the file.  Returns 0; 1 when `backend` cannot run heads of `dim` here
 * (above parrot_prefill_bf16_best(dim); nothing written); 2 when scratch memory could
 * not be allocated (out may be partly written). */
int parrot_prefill_attention(const float *q, int64_t q_stride, const int64_t *q_row, const int64_t *n,
                             const int64_t *start, int64_t chunks, const uint16_t *k, const uint16_t *v,
                             const int64_t *blocks, const int64_t *blk_off, int64_t block_size, int64_t kv_heads,
                             int64_t group, int64_t dim, float scale, float *out, int64_t out_stride, int backend,
                             int threads) {
    if (backend < BACKEND_PORTABLE || backend > parrot_prefill_bf16_best(dim)) return 1;
#ifdef HAVE_DP
    if (backend != BACKEND_PORTABLE)
        return prefill_fast(q, q_stride, q_row, n, start, chunks, k, v, blocks, blk_off, block_size, kv_heads, group,
                            dim, scale, out, out_stride, backend, threads);
#endif
    return prefill_portable(q, q_stride, q_row, n, start, chunks, k, v, blocks, blk_off, block_size, kv_heads,
                            group, dim, scale, out, out_stride, threads);
}
