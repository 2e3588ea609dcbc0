/* The AMX tile configuration shared by the kernels that use the tiles (bf16_linear.c,
 * prefill_bf16.c): every one of the eight tiles 16 rows of 64 bytes (a 16 x 16 fp32
 * accumulator, or 16 rows of 32 bf16).  Included only where the compiler targets
 * AMX-BF16 and PARROT_PORTABLE is not defined. */
#ifndef PARROT_AMX_TILES_H
#define PARROT_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif
