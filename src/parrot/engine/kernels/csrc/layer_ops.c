/* Fused elementwise steps of a decoder layer (CPU), each replacing several
 * PyTorch ops that would otherwise each make a pass over the activations.
 *
 * Activations are row-major [rows, dim] fp32 unless a flag says bf16 (stored
 * as the top 16 bits of an fp32, rounded to nearest even like PyTorch's cast).
 * Rows are split over `threads` OpenMP threads; every function writes all of
 * its outputs and nothing else.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parrot_ops.h"

#if defined(__AVX512F__) && !defined(PARROT_PORTABLE)
#define LAYER_AVX512 1
#include "simd.h"
#ifdef __AVX512BF16__
#define LAYER_BF16_STORE 1
static inline void store16_bf16(uint16_t *dst, __m512 v) {
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
}
#else
#define LAYER_BF16_STORE 0
static inline void store16_bf16(uint16_t *dst, __m512 v) { (void)dst, (void)v; }
#endif
#endif

static inline float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch does; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int bf16, int64_t i, float x) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* h += delta (when delta is not NULL; delta fp32 or bf16), then
 * out = h / sqrt(mean(h^2) + eps) * weight, out fp32 or bf16.  h: [rows, dim]. */
void parrot_add_rms_norm(float *h, const void *delta, int delta_bf16, const float *weight, float eps,
                         int64_t rows, int64_t dim, void *out, int out_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * dim;
        if (delta)
            for (int64_t i = 0; i < dim; i++) x[i] += load(delta, delta_bf16, r * dim + i);
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) store(out, out_bf16, r * dim + i, x[i] * inv * weight[i]);
    }
}

/* Rotary embedding in place: for t < rows and each of `heads` head vectors of
 * `dim` at x + t * row_stride + head * dim, x = x * cos[t] + rotate_half(x) * sin[t]
 * with rotate_half(x) = (-x2, x1) for the halves x1, x2 (the HF layout; cos and
 * sin are [rows, dim] with their halves repeated). */
void parrot_rope(float *x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride, const float *cos_t,
                 const float *sin_t, int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + t * dim, *s = sin_t + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* SwiGLU's middle: out[r, i] = silu(gu[r, i]) * gu[r, inter + i] for i < inter, with
 * silu(g) = g * sigmoid(g) and sigmoid from exp(-|g|) (never overflows).  gu:
 * [rows, 2 * inter] (the fused gate/up GEMM's output), out: [rows, inter]; each
 * fp32 or bf16. */
static inline float silu_mul1(float g, float u) {
    const float e = expf(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e)) * u;
}

void parrot_silu_mul(const void *gu, int gu_bf16, int64_t rows, int64_t inter, void *out, int out_bf16,
                     int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g0 = r * 2 * inter, u0 = g0 + inter, o0 = r * inter;
        int64_t i = 0;
#ifdef LAYER_AVX512
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= inter && (!out_bf16 || LAYER_BF16_STORE); i += 16) {
            const __m512 g = load16(gu, gu_bf16, g0 + i), u = load16(gu, gu_bf16, u0 + i);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
            const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e); /* g < 0: e / (1 + e) */
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
            if (out_bf16)
                store16_bf16((uint16_t *)out + o0 + i, y);
            else
                _mm512_storeu_ps((float *)out + o0 + i, y);
        }
#endif
        for (; i < inter; i++)
            store(out, out_bf16, o0 + i, silu_mul1(load(gu, gu_bf16, g0 + i), load(gu, gu_bf16, u0 + i)));
    }
}
