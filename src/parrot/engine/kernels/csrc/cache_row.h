/* Reading one cache row as fp32, shared by the portable C of the attention kernels
 * (decode_rows.c, shared_rows.c).  Plain C: included by every build. */
#ifndef PARROT_CACHE_ROW_H
#define PARROT_CACHE_ROW_H
#include <stdint.h>
#include <string.h>

/* Row `row` of kv head `head` of a cache viewed as [N, kv_heads, dim], as fp32: a
 * pointer into the cache, or `buf` (dim floats) filled from bf16 (a bf16 value is the
 * top half of an fp32 bit pattern). */
static inline const float *cache_row(const void *cache, int bf16, int64_t row, int64_t head, int64_t kv_heads,
                                     int64_t dim, float *buf) {
    const int64_t at = (row * kv_heads + head) * dim;
    if (!bf16) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
    for (int64_t i = 0; i < dim; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(&buf[i], &bits, sizeof bits);
    }
    return buf;
}
#endif
