/* Scalar bf16 conversions shared by the bf16 kernels (bf16_linear.c, prefill_bf16.c).
 *
 * bf16_round: fp32 to bf16, rounding to nearest even, as PyTorch's .to(torch.bfloat16)
 * does (a NaN stays a quiet NaN).  bf16_value: the exact fp32 value of a bf16. */
#ifndef PARROT_BF16_SCALAR_H
#define PARROT_BF16_SCALAR_H

#include <stdint.h>
#include <string.h>

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

#endif
