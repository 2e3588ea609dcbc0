/* Single-query decode attention read straight from a paged KV cache (CPU).
 *
 * Row r is one sequence's query (row seqs[r] of q) attending to the keys at the
 * flat cache rows tok[r * width + t] for t < lens[r]; the cache is viewed as
 * [N, KVH, D] (fp32, or bf16 when kv_bf16 is set).  For each kv head h and each
 * of the G query heads grouped on it, the kernel writes the normalised output
 * out[r, h * G + g, :] and the log-sum-exp of the scores lse[r, h * G + g]; q is
 * already scaled.  Everything is computed in fp32 with an online softmax over
 * tiles of TILE keys, so no K/V is copied out of the cache.  Work is split over
 * (row, kv head) pairs on `threads` OpenMP threads.
 *
 * Two implementations of one (row, kv head) task: AVX-512 intrinsics for head
 * dims that are multiples of 16 (specialised for 64 and 128; built when the
 * compiler targets AVX-512 and PARROT_PORTABLE is not defined), and portable C
 * for everything else.
 *
 * Invariants: lens[r] >= 1 and every listed token row is < N (the caller's);
 * out and lse are fully written; a NaN score reaches its row's output (the
 * running maximum may skip a NaN, the exponentials and sums do not).
 */
#include <math.h>
#include <stdint.h>

#include "cache_row.h"
#include "parrot_ops.h"

#define TILE 16

/* ------------------------------------------------------------ portable C */

/* The online softmax's starting state for m query vectors of dim: no keys seen. */
static inline void softmax_start(float *run_max, float *run_sum, float *acc, int64_t m, int64_t dim) {
    for (int64_t g = 0; g < m; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    for (int64_t i = 0; i < m * dim; i++) acc[i] = 0.0f;
}

static void task_portable(const float *qh, const void *k, const void *v, int bf16, const int64_t *tok,
                          int64_t n, int64_t head, int64_t kv_heads, int64_t group, int64_t dim, float *out,
                          float *lse) {
    float acc[group * dim], run_max[group], run_sum[group], s[group * TILE], buf[dim];
    softmax_start(run_max, run_sum, acc, group, dim);
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t nt = n - t0 < TILE ? n - t0 : TILE;
        for (int64_t j = 0; j < nt; j++) {
            const float *kr = cache_row(k, bf16, tok[t0 + j], head, kv_heads, dim, buf);
            for (int64_t g = 0; g < group; g++) {
                float d = 0.0f;
                for (int64_t i = 0; i < dim; i++) d += qh[g * dim + i] * kr[i];
                s[g * TILE + j] = d;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *sg = s + g * TILE, mx = run_max[g];
            for (int64_t j = 0; j < nt; j++)
                if (sg[j] > mx) mx = sg[j];
            if (mx != run_max[g]) { /* rescale what was summed against the old maximum */
                const float alpha = expf(run_max[g] - mx);
                run_sum[g] *= alpha;
                for (int64_t i = 0; i < dim; i++) acc[g * dim + i] *= alpha;
                run_max[g] = mx;
            }
            for (int64_t j = 0; j < nt; j++) {
                sg[j] = expf(sg[j] - mx);
                run_sum[g] += sg[j];
            }
        }
        for (int64_t j = 0; j < nt; j++) {
            const float *vr = cache_row(v, bf16, tok[t0 + j], head, kv_heads, dim, buf);
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += s[g * TILE + j] * vr[i];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        for (int64_t i = 0; i < dim; i++) out[g * dim + i] = acc[g * dim + i] / run_sum[g];
        lse[g] = run_max[g] + logf(run_sum[g]);
    }
}

/* ------------------------------------------------------------ AVX-512 */
#if defined(__AVX512F__) && !defined(PARROT_PORTABLE)
#define HAVE_AVX512 1
#include "simd.h"

/* kv heads [h0, h0 + nh) of one row, for dim % 16 == 0: the row's keys are read
 * token by token, all nh heads of a token at once (one contiguous run of the
 * cache row), so the hardware prefetcher streams whole blocks; the next token's
 * row is prefetched explicitly, since consecutive blocks are anywhere in the
 * pool.  q, out and lse point at the row's head h0; m = nh * group query vectors
 * share the online softmax code.  Inlined into callers that fix `dim`. */
static inline __attribute__((always_inline)) void task16(
    const float *q, const void *k, const void *v, int bf16, const int64_t *tok, int64_t n, int64_t h0,
    int64_t nh, int64_t kv_heads, int64_t group, const int64_t dim, float *out, float *lse) {
    const int64_t nv = dim / 16, m = nh * group, esize = bf16 ? 2 : 4;
    float acc[m * dim] __attribute__((aligned(64)));
    float sc[m * TILE] __attribute__((aligned(64)));
    float run_max[m], run_sum[m];
    softmax_start(run_max, run_sum, acc, m, dim);
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t nt = n - t0 < TILE ? n - t0 : TILE;
        for (int64_t j = 0; j < nt; j++) {
            if (t0 + j + 1 < n) { /* the next token's keys and values */
                const int64_t next = (tok[t0 + j + 1] * kv_heads + h0) * dim * esize;
                for (int64_t b = 0; b < nh * dim * esize; b += 64) {
                    __builtin_prefetch((const char *)k + next + b);
                    __builtin_prefetch((const char *)v + next + b);
                }
            }
            const int64_t row = (tok[t0 + j] * kv_heads + h0) * dim;
            for (int64_t hh = 0; hh < nh; hh++) {
                __m512 kr[nv];
                for (int64_t c = 0; c < nv; c++) kr[c] = load16(k, bf16, row + hh * dim + 16 * c);
                for (int64_t g = hh * group; g < (hh + 1) * group; g++) {
                    __m512 d = _mm512_mul_ps(_mm512_loadu_ps(q + g * dim), kr[0]);
                    for (int64_t c = 1; c < nv; c++)
                        d = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + 16 * c), kr[c], d);
                    sc[g * TILE + j] = _mm512_reduce_add_ps(d);
                }
            }
        }
        const __mmask16 live = (__mmask16)((1u << nt) - 1u);
        for (int64_t g = 0; g < m; g++) {
            __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc + g * TILE);
            float mx = _mm512_reduce_max_ps(s);
            mx = mx > run_max[g] ? mx : run_max[g];
            if (mx != run_max[g]) { /* rescale what was summed against the old maximum */
                const float alpha = expf(run_max[g] - mx);
                run_sum[g] *= alpha;
                const __m512 a = _mm512_set1_ps(alpha);
                for (int64_t c = 0; c < nv; c++) {
                    float *at = acc + g * dim + 16 * c;
                    _mm512_store_ps(at, _mm512_mul_ps(a, _mm512_load_ps(at)));
                }
                run_max[g] = mx;
            }
            __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
            run_sum[g] += _mm512_reduce_add_ps(p);
            _mm512_store_ps(sc + g * TILE, p);
        }
        for (int64_t j = 0; j < nt; j++) {
            const int64_t row = (tok[t0 + j] * kv_heads + h0) * dim;
            for (int64_t hh = 0; hh < nh; hh++) {
                __m512 vr[nv];
                for (int64_t c = 0; c < nv; c++) vr[c] = load16(v, bf16, row + hh * dim + 16 * c);
                for (int64_t g = hh * group; g < (hh + 1) * group; g++) {
                    const __m512 p = _mm512_set1_ps(sc[g * TILE + j]);
                    for (int64_t c = 0; c < nv; c++) {
                        float *at = acc + g * dim + 16 * c;
                        _mm512_store_ps(at, _mm512_fmadd_ps(p, vr[c], _mm512_load_ps(at)));
                    }
                }
            }
        }
    }
    for (int64_t g = 0; g < m; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / run_sum[g]);
        for (int64_t c = 0; c < nv; c++)
            _mm512_storeu_ps(out + g * dim + 16 * c, _mm512_mul_ps(inv, _mm512_load_ps(acc + g * dim + 16 * c)));
        lse[g] = run_max[g] + logf(run_sum[g]);
    }
}

static void task_dim64(const float *q, const void *k, const void *v, int bf16, const int64_t *tok, int64_t n,
                       int64_t h0, int64_t nh, int64_t kv_heads, int64_t group, float *out, float *lse) {
    task16(q, k, v, bf16, tok, n, h0, nh, kv_heads, group, 64, out, lse);
}

static void task_dim128(const float *q, const void *k, const void *v, int bf16, const int64_t *tok, int64_t n,
                        int64_t h0, int64_t nh, int64_t kv_heads, int64_t group, float *out, float *lse) {
    task16(q, k, v, bf16, tok, n, h0, nh, kv_heads, group, 128, out, lse);
}
#endif

/* q: [*, KVH * G, D] fp32 rows of q_stride elements; tok: [rows, width]; out:
 * [rows, KVH * G, D]; lse: [rows, KVH * G].  Each task is one row's run of kv
 * heads: all of them when there are enough rows to keep every thread busy, else
 * the heads are split so that there are about two tasks per thread.  Returns 1
 * when the AVX-512 path ran. */
int parrot_decode_rows(const float *q, int64_t q_stride, const int64_t *seqs, const void *k, const void *v,
                       int kv_bf16, const int64_t *tok, const int64_t *lens, int64_t rows, int64_t width,
                       int64_t kv_heads, int64_t group, int64_t dim, float *out, float *lse, int threads) {
    const int64_t heads = kv_heads * group;
    int64_t splits = rows >= 2 * threads ? 1 : (2 * threads + rows - 1) / rows;
    if (splits > kv_heads) splits = kv_heads;
    const int64_t per = (kv_heads + splits - 1) / splits; /* kv heads per task */
    const int64_t tasks = rows * splits;
#ifdef HAVE_AVX512
    const int vector = dim % 16 == 0;
#else
    const int vector = 0;
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t r = task / splits, h0 = (task % splits) * per;
        const int64_t nh = h0 + per > kv_heads ? kv_heads - h0 : per;
        if (nh <= 0) continue;
        const float *qh = q + seqs[r] * q_stride + h0 * group * dim;
        const int64_t *t = tok + r * width;
        float *o = out + (r * heads + h0 * group) * dim, *l = lse + r * heads + h0 * group;
#ifdef HAVE_AVX512
        if (dim == 64) {
            task_dim64(qh, k, v, kv_bf16, t, lens[r], h0, nh, kv_heads, group, o, l);
            continue;
        }
        if (dim == 128) {
            task_dim128(qh, k, v, kv_bf16, t, lens[r], h0, nh, kv_heads, group, o, l);
            continue;
        }
        if (dim % 16 == 0) {
            task16(qh, k, v, kv_bf16, t, lens[r], h0, nh, kv_heads, group, dim, o, l);
            continue;
        }
#endif
        for (int64_t hh = 0; hh < nh; hh++)
            task_portable(qh + hh * group * dim, k, v, kv_bf16, t, lens[r], h0 + hh, kv_heads, group, dim,
                          o + hh * group * dim, l + hh * group);
    }
    return vector;
}

/* The exact merge of normalised partial results (each with its log-sum-exp): sequence
 * b's partials are rows slots[starts[b] .. starts[b + 1]) of out [S, H, D] / lse [S, H];
 * with m = the largest of their lse and w = exp(lse - m),
 *   result[b, h] = sum w * out / sum w.
 * Every sequence has >= 1 partial (the caller's); result [batch, H, D] is fully
 * written; a NaN lse or output reaches its sequence's result for that head. */
void parrot_merge_lse(const float *out, const float *lse, const int64_t *starts, const int64_t *slots,
                      int64_t batch, int64_t heads, int64_t dim, float *result, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, h = bh % heads, lo = starts[b], hi = starts[b + 1];
        float top = -INFINITY;
        for (int64_t i = lo; i < hi; i++) {
            const float x = lse[slots[i] * heads + h];
            if (x > top) top = x;
        }
        float *r = result + bh * dim;
        for (int64_t d = 0; d < dim; d++) r[d] = 0.0f;
        float den = 0.0f;
        for (int64_t i = lo; i < hi; i++) {
            const int64_t s = slots[i];
            const float w = expf(lse[s * heads + h] - top); /* NaN lse: NaN weight */
            const float *o = out + (s * heads + h) * dim;
            den += w;
            for (int64_t d = 0; d < dim; d++) r[d] += w * o[d];
        }
        const float inv = 1.0f / den;
        for (int64_t d = 0; d < dim; d++) r[d] *= inv;
    }
}
