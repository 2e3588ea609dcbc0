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
