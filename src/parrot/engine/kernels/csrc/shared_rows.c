/* Decode attention of one shared prefix for all the queries under it (CPU, AVX-512).
 *
 * A shared row is n keys (flat cache rows tok[0..n), cache viewed as [N, KVH, D],
 * fp32 or bf16) read by m sequences (rows seqs[0..m) of q, already scaled).  Per
 * kv head h its L = m * G query vectors are *lanes*: lane i is query head
 * h * G + i % G of sequence seqs[i / G].  Lanes go across the vector registers,
 * 32 per chunk, so that every step is vertical:
 *
 *   scores    S[key][lane] += K[key][d] (broadcast) * Qt[d][lane]   (Qt: the chunk's
 *             queries transposed once per task; 8 keys x 32 lanes of accumulators)
 *   softmax   per lane over the tile's keys: max, exp, sum are element-wise on rows
 *             of S, with no horizontal reduction;
 *   values    O[lane][:] += P[key][lane] (broadcast) * V[key][:]    (4 lanes x 64 dims
 *             of accumulators).
 *
 * Each key and value row is read from memory once per kv head and reused for all
 * lanes from cache (one tile is 32 keys).  Work: (kv head, run of keys) tasks on
 * `threads` OpenMP threads, or, with few lanes, (all kv heads, run of keys) tasks that
 * walk the cache rows in address order; keys are split when tasks would be fewer than
 * two per thread, and the split partial states are merged exactly (log-sum-exp).
 *
 * Output: out [m, KVH * G, D] normalised, lse [m, KVH * G] (the log-sum-exp of
 * each query's scores), both fully written.  A NaN score reaches its lane's output.
 * The AVX-512 kernel is built for D % 64 == 0 (parrot_shared_rows_supported: the
 * engine uses the kernel only then, other layouts keep the PyTorch path); every
 * other build and head dim runs the portable C below (the same results up to
 * rounding order), so the kernel's contract is tested on every CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache_row.h"
#include "parrot_ops.h"

/* ------------------------------------------------------------ portable C */

/* Per (kv head, lane): the scores over the run's keys, their maximum, then the
 * exponentials' sum and the weighted values in one more pass over the keys.  Scratch:
 * n scores and two bf16 rows per (kv head, lane).  Returns 0, or 2 (nothing written)
 * when the scratch cannot be allocated. */
static int shared_portable(const float *q, int64_t q_stride, const int64_t *seqs, int64_t m, const void *k,
                           const void *v, int bf16, const int64_t *tok, int64_t n, int64_t kv_heads,
                           int64_t group, int64_t dim, float *out, float *lse, int threads) {
    const int64_t lanes = m * group, heads = kv_heads * group, each = n + 2 * dim;
    float *scratch = malloc(sizeof(float) * (size_t)(kv_heads * lanes) * (size_t)each);
    if (!scratch) return 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t hl = 0; hl < kv_heads * lanes; hl++) {
        const int64_t h = hl / lanes, i = hl % lanes, head = h * group + i % group;
        const float *qv = q + seqs[i / group] * q_stride + head * dim;
        float *s = scratch + hl * each, *kbuf = s + n, *vbuf = kbuf + dim;
        float *o = out + ((i / group) * heads + head) * dim;
        float top = -INFINITY;
        int nan = 0;
        for (int64_t j = 0; j < n; j++) {
            const float *kr = cache_row(k, bf16, tok[j], h, kv_heads, dim, kbuf);
            float x = 0.0f;
            for (int64_t d = 0; d < dim; d++) x += qv[d] * kr[d];
            s[j] = x;
            nan |= isnan(x);
            if (x > top) top = x;
        }
        float den = 0.0f;
        for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float p = expf(s[j] - top);
            const float *vr = cache_row(v, bf16, tok[j], h, kv_heads, dim, vbuf);
            den += p;
            for (int64_t d = 0; d < dim; d++) o[d] += p * vr[d];
        }
        if (nan) den = NAN;
        for (int64_t d = 0; d < dim; d++) o[d] /= den;
        lse[(i / group) * heads + head] = top + logf(den);
    }
    free(scratch);
    return 0;
}

#if defined(__AVX512F__) && !defined(PARROT_PORTABLE)
#include "simd.h"
#define SHARED_AVX512 1

#define KT 32 /* keys per tile */
#define CH 32 /* lanes per chunk */

/* One task's state and scratch, carved from one allocation (all 64-byte aligned). */
typedef struct {
    float *qt;      /* [chunks][D][CH]: lanes transposed, zero beyond L */
    float *acc;     /* [chunks * CH][D]: unnormalised outputs */
    float *run_max; /* [chunks * CH] */
    float *run_sum; /* [chunks * CH] */
    float *p;       /* [KT][CH]: one chunk's scores, then probabilities */
    float *alpha;   /* [CH]: the chunk's rescale factors of this tile */
    float *kbuf;    /* [KT][D]: a bf16 tile's keys as fp32 */
} State;

static size_t state_floats(int64_t chunks, int64_t dim) {
    return (size_t)(2 * chunks * CH * dim + 2 * chunks * CH + KT * CH + CH + KT * dim);
}

static State state_at(float *base, int64_t chunks, int64_t dim) {
    State s;
    s.qt = base;
    s.acc = s.qt + chunks * CH * dim;
    s.run_max = s.acc + chunks * CH * dim;
    s.run_sum = s.run_max + chunks * CH;
    s.p = s.run_sum + chunks * CH;
    s.alpha = s.p + KT * CH;
    s.kbuf = s.alpha + CH;
    return s;
}

/* S rows for 8 keys (pointers kp, fp32) x nq * 16 lanes of one chunk; keys past the
 * tile's end point at a real row and their scores are ignored. */
static inline __attribute__((always_inline)) void scores8(const float *qt, const float *const *kp,
                                                          const int64_t dim, const int nq, float *p) {
    __m512 acc[8][2];
    for (int r = 0; r < 8; r++)
        for (int w = 0; w < nq; w++) acc[r][w] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m512 qv[2];
        for (int w = 0; w < nq; w++) qv[w] = _mm512_load_ps(qt + d * CH + 16 * w);
        for (int r = 0; r < 8; r++) {
            const __m512 kb = _mm512_set1_ps(kp[r][d]);
            for (int w = 0; w < nq; w++) acc[r][w] = _mm512_fmadd_ps(kb, qv[w], acc[r][w]);
        }
    }
    for (int r = 0; r < 8; r++)
        for (int w = 0; w < nq; w++) _mm512_store_ps(p + r * CH + 16 * w, acc[r][w]);
}

/* Fold one tile's scores p[0..nt) of lane vectors [0, nq) into the running max/sum:
 * p becomes exp(score - new max) (0 past nt), alpha the rescale factor. */
static inline void softmax_tile(float *p, int64_t nt, int nq, float *run_max, float *run_sum, float *alpha) {
    for (int w = 0; w < nq; w++) {
        __m512 mx = _mm512_load_ps(run_max + 16 * w);
        for (int64_t j = 0; j < nt; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(p + j * CH + 16 * w));
        const __m512 old = _mm512_load_ps(run_max + 16 * w);
        const __m512 a = exp512(_mm512_sub_ps(old, mx)); /* <= 1; 0 (or ~1e-38) from -inf */
        __m512 sum = _mm512_mul_ps(a, _mm512_load_ps(run_sum + 16 * w));
        for (int64_t j = 0; j < nt; j++) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(p + j * CH + 16 * w), mx));
            _mm512_store_ps(p + j * CH + 16 * w, e);
            sum = _mm512_add_ps(sum, e);
        }
        for (int64_t j = nt; j < KT; j++) _mm512_store_ps(p + j * CH + 16 * w, _mm512_setzero_ps());
        _mm512_store_ps(run_max + 16 * w, mx);
        _mm512_store_ps(run_sum + 16 * w, sum);
        _mm512_store_ps(alpha + 16 * w, a);
    }
}

/* acc[lanes l0..l0+4)[d0..d0+64) = alpha * acc + sum over the tile's keys of p * V. */
static inline __attribute__((always_inline)) void values4(float *acc, const float *p, const float *alpha,
                                                          const void *v, int bf16, const int64_t *vrow,
                                                          int64_t nt, int64_t l0, int64_t d0, int64_t dim) {
    __m512 o[4][4];
    for (int l = 0; l < 4; l++) {
        const __m512 a = _mm512_set1_ps(alpha[l0 + l]);
        for (int z = 0; z < 4; z++) o[l][z] = _mm512_mul_ps(a, _mm512_load_ps(acc + (l0 + l) * dim + d0 + 16 * z));
    }
    for (int64_t j = 0; j < nt; j++) {
        __m512 vv[4];
        for (int z = 0; z < 4; z++) vv[z] = load16(v, bf16, vrow[j] + d0 + 16 * z);
        for (int l = 0; l < 4; l++) {
            const __m512 pb = _mm512_set1_ps(p[j * CH + l0 + l]);
            for (int z = 0; z < 4; z++) o[l][z] = _mm512_fmadd_ps(pb, vv[z], o[l][z]);
        }
    }
    for (int l = 0; l < 4; l++)
        for (int z = 0; z < 4; z++) _mm512_store_ps(acc + (l0 + l) * dim + d0 + 16 * z, o[l][z]);
}

/* State s for kv head h, started: its lanes' queries transposed, nothing accumulated. */
static void state_start(State s, const float *q, int64_t q_stride, const int64_t *seqs, int64_t lanes, int64_t h,
                        int64_t group, int64_t dim) {
    const int64_t chunks = (lanes + CH - 1) / CH;
    memset(s.qt, 0, sizeof(float) * chunks * CH * dim);
    for (int64_t i = 0; i < lanes; i++) {
        const float *qi = q + seqs[i / group] * q_stride + (h * group + i % group) * dim;
        float *col = s.qt + (i / CH) * CH * dim + i % CH;
        for (int64_t d = 0; d < dim; d++) col[d * CH] = qi[d];
    }
    memset(s.acc, 0, sizeof(float) * chunks * CH * dim);
    for (int64_t i = 0; i < chunks * CH; i++) {
        s.run_max[i] = -INFINITY;
        s.run_sum[i] = 0.0f;
    }
}

/* Prefetch the key and value rows of keys [t0, t1) of kv head h. */
static inline void prefetch_rows(const void *k, const void *v, const int64_t *tok, int64_t t0, int64_t t1, int64_t h,
                                 int64_t kv_heads, int64_t dim, int64_t esize) {
    for (int64_t j = t0; j < t1; j++) {
        const int64_t at = (tok[j] * kv_heads + h) * dim * esize;
        for (int64_t o = 0; o < dim * esize; o += 64) {
            __builtin_prefetch((const char *)k + at + o);
            __builtin_prefetch((const char *)v + at + o);
        }
    }
}

/* Keys [t0, t0 + nt) (nt <= KT) of kv head h for all `lanes` lanes, folded into s. */
static void tile_step(State s, int64_t lanes, const void *k, const void *v, int bf16, const int64_t *tok, int64_t t0,
                      int64_t nt, int64_t h, int64_t kv_heads, const int64_t dim) {
    const int64_t chunks = (lanes + CH - 1) / CH;
    int64_t row[KT];
    const float *kp[KT];
    for (int64_t j = 0; j < KT; j++) row[j] = (tok[t0 + (j < nt ? j : nt - 1)] * kv_heads + h) * dim;
    for (int64_t j = 0; j < KT; j++) {
        if (!bf16) {
            kp[j] = (const float *)k + row[j];
            continue;
        }
        float *dst = s.kbuf + j * dim;
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, load16(k, 1, row[j] + d));
        kp[j] = dst;
    }
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t live = lanes - c * CH < CH ? lanes - c * CH : CH;
        const int nq = live > 16 ? 2 : 1;
        const float *qt = s.qt + c * CH * dim;
        for (int64_t j = 0; j < nt; j += 8) {
            if (nq == 2)
                scores8(qt, kp + j, dim, 2, s.p + j * CH);
            else
                scores8(qt, kp + j, dim, 1, s.p + j * CH);
        }
        softmax_tile(s.p, nt, nq, s.run_max + c * CH, s.run_sum + c * CH, s.alpha);
        float *acc = s.acc + c * CH * dim;
        for (int64_t l0 = 0; l0 < live; l0 += 4)
            for (int64_t d0 = 0; d0 < dim; d0 += 64) values4(acc, s.p, s.alpha, v, bf16, row, nt, l0, d0, dim);
    }
}

/* Keys [a, b) of kv heads [h0, h1) for all lanes; kv head h's state is states(h), started
 * here.  Tiles go in the outer loop and heads in the inner one, so that with several
 * heads the cache rows are walked in address order (all heads of a token are adjacent). */
static void shared_task(const float *q, int64_t q_stride, const int64_t *seqs, int64_t lanes, const void *k,
                        const void *v, int bf16, const int64_t *tok, int64_t a, int64_t b, int64_t h0, int64_t h1,
                        int64_t kv_heads, int64_t group, const int64_t dim, float *mem, size_t each, int64_t splits,
                        int64_t split) {
    const int64_t chunks = (lanes + CH - 1) / CH, esize = bf16 ? 2 : 4;
#define STATE(h) state_at(mem + each * (size_t)((h) * splits + split), chunks, dim)
    for (int64_t h = h0; h < h1; h++) state_start(STATE(h), q, q_stride, seqs, lanes, h, group, dim);
    for (int64_t t0 = a; t0 < b; t0 += KT) {
        const int64_t nt = b - t0 < KT ? b - t0 : KT;
        for (int64_t h = h0; h < h1; h++) {
            /* The next (tile, head)'s rows: consecutive blocks are anywhere in the pool, and
             * one head's rows are a cache row apart, so the hardware prefetcher misses them.
             * (Two tiles ahead, or into L2 only, measured no faster.) */
            if (h + 1 < h1)
                prefetch_rows(k, v, tok, t0, t0 + nt, h + 1, kv_heads, dim, esize);
            else if (t0 + KT < b)
                prefetch_rows(k, v, tok, t0 + KT, t0 + 2 * KT < b ? t0 + 2 * KT : b, h0, kv_heads, dim, esize);
            tile_step(STATE(h), lanes, k, v, bf16, tok, t0, nt, h, kv_heads, dim);
        }
    }
#undef STATE
}
#endif

/* Whether the AVX-512 kernel runs head dim `dim` in this build (else the portable C). */
int parrot_shared_rows_supported(int64_t dim) {
#ifdef SHARED_AVX512
    return dim > 0 && dim % 64 == 0;
#else
    (void)dim;
    return 0;
#endif
}

/* See the top of the file.  Returns 0 on success, 2 when scratch memory could not be
 * allocated (nothing written then). */
int parrot_shared_rows(const float *q, int64_t q_stride, const int64_t *seqs, int64_t m, const void *k,
                       const void *v, int kv_bf16, const int64_t *tok, int64_t n, int64_t kv_heads,
                       int64_t group, int64_t dim, float *out, float *lse, int threads) {
#ifdef SHARED_AVX512
    if (!parrot_shared_rows_supported(dim))
        return shared_portable(q, q_stride, seqs, m, k, v, kv_bf16, tok, n, kv_heads, group, dim, out, lse, threads);
    const int64_t lanes = m * group, chunks = (lanes + CH - 1) / CH, heads = kv_heads * group;
    /* Few lanes (at most two chunks): each key row feeds little arithmetic, so memory
     * traffic binds; tasks then take a run of keys for all kv heads (rows read in address
     * order).  More lanes: a task takes one kv head, whose state stays in cache.  Key
     * splits: enough tasks for two per thread (a multiple of the thread count), each
     * split at least two tiles long. */
    const int all_heads = chunks <= 2 && kv_heads > 1;
    const int64_t units = all_heads ? 1 : kv_heads;
    int64_t splits = 1;
    while (units * splits < 2 * threads || (units * splits) % threads) splits++;
    if (splits > (n + 2 * KT - 1) / (2 * KT)) splits = (n + 2 * KT - 1) / (2 * KT);
    if (splits < 1) splits = 1;
    const int64_t per = (n + splits - 1) / splits, tasks = units * splits;
    const size_t each = (state_floats(chunks, dim) + 15) / 16 * 16;
    float *mem = aligned_alloc(64, sizeof(float) * each * (size_t)(kv_heads * splits));
    if (!mem) return 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t sp = t % splits, a = sp * per, b = a + per < n ? a + per : n;
        const int64_t h0 = all_heads ? 0 : t / splits, h1 = all_heads ? kv_heads : h0 + 1;
        if (a >= b) { /* an empty split: contributes nothing (weight 0 in the merge) */
            for (int64_t h = h0; h < h1; h++) {
                State s = state_at(mem + each * (size_t)(h * splits + sp), chunks, dim);
                memset(s.acc, 0, sizeof(float) * chunks * CH * dim);
                for (int64_t i = 0; i < chunks * CH; i++) s.run_max[i] = -INFINITY, s.run_sum[i] = 0.0f;
            }
            continue;
        }
        shared_task(q, q_stride, seqs, lanes, k, v, kv_bf16, tok, a, b, h0, h1, kv_heads, group, dim, mem, each,
                    splits, sp);
    }
    /* Merge the splits of each (kv head, lane) and normalise. */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t hl = 0; hl < kv_heads * lanes; hl++) {
        const int64_t h = hl / lanes, i = hl % lanes;
        float top = -INFINITY;
        int nan = 0;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float x = state_at(mem + each * (size_t)(h * splits + sp), chunks, dim).run_max[i];
            nan |= isnan(x);
            if (x > top) top = x;
        }
        float den = 0.0f, w[splits];
        for (int64_t sp = 0; sp < splits; sp++) {
            const State s = state_at(mem + each * (size_t)(h * splits + sp), chunks, dim);
            w[sp] = s.run_sum[i] == 0.0f ? 0.0f : expf(s.run_max[i] - top);
            den += w[sp] * s.run_sum[i];
        }
        if (nan) den = NAN;
        float *o = out + ((i / group) * heads + h * group + i % group) * dim;
        for (int64_t d = 0; d < dim; d++) {
            float x = 0.0f;
            for (int64_t sp = 0; sp < splits; sp++)
                x += w[sp] * state_at(mem + each * (size_t)(h * splits + sp), chunks, dim).acc[i * dim + d];
            o[d] = x / den;
        }
        lse[(i / group) * heads + h * group + i % group] = top + logf(den);
    }
    free(mem);
    return 0;
#else
    return shared_portable(q, q_stride, seqs, m, k, v, kv_bf16, tok, n, kv_heads, group, dim, out, lse, threads);
#endif
}
