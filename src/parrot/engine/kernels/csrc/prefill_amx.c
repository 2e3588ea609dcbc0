/* Causal attention of prefill chunks over the paged bf16 KV cache, on Intel AMX tiles.
 *
 * A prompt's attention is small next to its projections in FLOPs, but PyTorch's CPU
 * flash kernel computes it in AVX-512 at a fraction of what the tile unit does, so on
 * this project's CPUs it took about a third of a prefill step.  This kernel computes
 * the two products (scores and the weighted sum of values) on AMX tiles and the
 * softmax in AVX-512, reading the keys and values from the paged cache in place of a
 * gathered copy.
 *
 * Chunk c has n[c] queries, rows q_row[c] .. + n[c] of q ([T, H, D] fp32, rows q_stride
 * floats apart, H = KVH * G, head h reading kv head h / G), at absolute positions
 * start[c] ..; its keys are positions [0, start[c] + n[c]) of its sequence, in the
 * cache blocks blocks[blk_off[c] ..] (block b holds positions [b * BS, (b + 1) * BS));
 * k and v are one layer's cache, [NB, BS, KVH, D] bf16.  Query i attends to the keys
 * at positions <= start[c] + i.  out rows are written like q's (fp32, out_stride).
 *
 * First, the keys and values of every chunk and kv head are copied once into the
 * layouts of the tile loads (VNNI pairs: kp for the scores' B operand, pairs along the
 * head dimension; vp for the values', pairs along the keys), zero past the last key,
 * 32 keys a work item.  Then each (chunk, head, block of 16 queries) is one work item,
 * the blocks with the most keys first:
 *   1. the queries, rounded to bf16, in a zero-padded [16, D] buffer (the A tiles);
 *   2. scores S = Q K^T for every 16 keys up to the block's last query (one 16 x 16
 *      fp32 tile over D / 32 tile products), stored in a [16, keys] buffer;
 *   3. per row: the maximum of the scaled scores over its visible keys, then
 *      p = exp(scale * s - max) (0 for keys it may not see), their fp32 sum, and p
 *      rounded to bf16 into a [16, keys] buffer (the A tiles of step 4);
 *   4. O = P V over 32 keys a tile product, up to four 16 x 16 fp32 output tiles at a
 *      time (64 of the D columns), then out = O / sum.
 * So every query's result is its softmax-weighted sum of values, like PyTorch's bf16
 * flash attention: products of bf16 values accumulated in fp32, the probabilities
 * rounded to bf16 before the second product (the tile unit sums in its own order:
 * results agree with other kernels up to that rounding).
 *
 * Invariants: the cache and q are never written; every out row of every chunk is
 * fully written (D columns of each head), nothing else of out.  The AMX code is built
 * where the compiler targets AMX-BF16 and PARROT_PORTABLE is not defined, and runs only
 * when Linux grants the tile state (parrot_amx_ready); everywhere else the same
 * function computes the same quantities in portable C (the tests run both).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parrot_ops.h"

static inline uint16_t bf16_of(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float float_of(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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
                for (int64_t d = 0; d < dim; d++) qb[d] = float_of(bf16_of(qi[d]));
                float most_score = -INFINITY;
                for (int64_t j = 0; j < seen; j++) {
                    const uint16_t *kj = k + cache_at(blk, j, bs, kv_heads, kvh, dim);
                    float s = 0.0f;
                    for (int64_t d = 0; d < dim; d++) s += qb[d] * float_of(kj[d]);
                    p[j] = s * scale;
                    if (p[j] > most_score) most_score = p[j];
                }
                float sum = 0.0f;
                for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
                for (int64_t j = 0; j < seen; j++) {
                    const float e = expf(p[j] - most_score);
                    sum += e;
                    const float w = float_of(bf16_of(e));
                    const uint16_t *vj = v + cache_at(blk, j, bs, kv_heads, kvh, dim);
                    for (int64_t d = 0; d < dim; d++) acc[d] += w * float_of(vj[d]);
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(PARROT_PORTABLE)
#define HAVE_AMX 1
#include "amx_tiles.h"
#include "simd.h"

/* Tiles 0-3: output accumulators; 4: a score tile; 5: A (queries or probabilities);
 * 6: B (keys or values) (configure_tiles, amx_tiles.h). */

/* Copy 32-key step `step` of a chunk's keys [0, total) of kv head kvh into kp (its B
 * tiles for the scores: [ceil(total / 16)][dim / 32][16 pair rows][16 keys x 2]) and
 * its values into vp (B tiles for P V: [ceil(total / 32)][dim / 16][16 key-pair rows]
 * [16 columns x 2]), zero past the last key. */
static void pack_step(const uint16_t *k, const uint16_t *v, const int64_t *blk, int64_t total, int64_t step,
                      int64_t bs, int64_t kv_heads, int64_t kvh, int64_t dim, uint16_t *kp, uint16_t *vp) {
    const int64_t dsteps = dim / 32, tcols = dim / 16;
    for (int64_t half = 0; half < 2; half++) { /* keys: two 16-key B-tile sets per step */
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

/* One work item: head h's queries [i0, i0 + rows) of a chunk starting at `start`
 * (see the top of the file).  qa [16, dim] bf16, s [16, stride] fp32, pa [16, stride]
 * bf16, o [16, 16] fp32: the thread's scratch; stride: a multiple of 32 >= the keys. */
static void attend_block(const float *q, int64_t q_stride, int64_t q_row0, int64_t i0, int64_t rows,
                         int64_t start, int64_t h, int64_t dim, float scale, const uint16_t *kp,
                         const uint16_t *vp, float *out, int64_t out_stride, uint16_t *qa, float *s,
                         uint16_t *pa, float *o, int64_t stride) {
    const int64_t dsteps = dim / 32, tcols = dim / 16;
    const int64_t seen = start + i0 + rows; /* keys the block's last query sees */
    const int64_t kblocks = (seen + 15) / 16, ksteps = (seen + 31) / 32;
    for (int64_t r = 0; r < 16; r++) {
        uint16_t *dst = qa + r * dim;
        if (r >= rows) {
            memset(dst, 0, sizeof(uint16_t) * (size_t)dim);
            continue;
        }
        const float *src = q + (q_row0 + i0 + r) * q_stride + h * dim;
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
    }
    for (int64_t kb = 0; kb < kblocks; kb++) { /* 2. scores */
        _tile_zero(4);
        for (int64_t ds = 0; ds < dsteps; ds++) {
            _tile_loadd(5, qa + ds * 32, dim * 2);
            _tile_loadd(6, kp + (kb * dsteps + ds) * 512, 64);
            _tile_dpbf16ps(4, 5, 6);
        }
        _tile_stored(4, s + kb * 16, stride * 4);
    }
    float sums[16];
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t r = 0; r < 16; r++) { /* 3. softmax numerators per row */
        const int64_t visible = r < rows ? start + i0 + r + 1 : 1; /* padding rows: any finite row */
        float *sr = s + r * stride;
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
        for (int64_t j = 0; j < ksteps * 32; j += 16) {
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
    for (int64_t t0 = 0; t0 < tcols; t0 += 4) { /* 4. P V, up to 64 columns at a time */
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
            for (int64_t r = 0; r < rows; r++) {
                float *dst = out + (q_row0 + i0 + r) * out_stride + h * dim + (t0 + t) * 16;
                _mm512_storeu_ps(dst, _mm512_div_ps(_mm512_load_ps(o + r * 16), _mm512_set1_ps(sums[r])));
            }
        }
    }
}
#endif

int parrot_prefill_amx_ready(int64_t dim) {
#ifdef HAVE_AMX
    return dim > 0 && dim % 32 == 0 && parrot_amx_ready();
#else
    (void)dim;
    return 0;
#endif
}

/* See the top of the file.  Returns 0 (portable C where the AMX kernel cannot run);
 * 2 when scratch memory could not be allocated (out may be partly written). */
int parrot_prefill_attention(const float *q, int64_t q_stride, const int64_t *q_row, const int64_t *n,
                             const int64_t *start, int64_t chunks, const uint16_t *k, const uint16_t *v,
                             const int64_t *blocks, const int64_t *blk_off, int64_t block_size, int64_t kv_heads,
                             int64_t group, int64_t dim, float scale, float *out, int64_t out_stride,
                             int threads) {
#ifdef HAVE_AMX
    if (!parrot_prefill_amx_ready(dim))
        return prefill_portable(q, q_stride, q_row, n, start, chunks, k, v, blocks, blk_off, block_size, kv_heads,
                                group, dim, scale, out, out_stride, threads);
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
        configure_tiles();
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
                         out_stride, qa, s, pa, o, stride);
        }
        _tile_release();
        free(qa);
        free(s);
        free(pa);
        free(o);
    }
    free(kp);
    free(vp);
    free(packed_at);
    return failed ? 2 : 0;
#else
    return prefill_portable(q, q_stride, q_row, n, start, chunks, k, v, blocks, blk_off, block_size, kv_heads,
                            group, dim, scale, out, out_stride, threads);
#endif
}
