/* AMX tiles, where the CPU has them and the kernels were built for them (AMX_BF16): asking Linux for the
 * tile state (once per process: arch_prctl ARCH_REQ_XCOMP_PERM), and the one tile shape the kernels use,
 * rows of 64 bytes (an A tile: up to 16 rows of x, 32 bfloat16 inputs each; a B tile: 16 pairs of
 * inputs, 16 outputs' pairs each; a C tile: up to 16 rows x 16 outputs in float32). Included by
 * float_linear.c, gguf_amx.c and gguf_linear.c.
 *
 * TDPBF16PS adds each pair of inputs' two products to a float32 sum, as vdpbf16ps does, but its sums
 * differ from a chain of vdpbf16ps in the last bits now and then (~2 outputs in 10,000 by one bf16
 * unit at 1,536 inputs): a kernel that uses the tiles uses them for every row count, so a row's bits
 * still do not depend on its batch.
 */
#ifndef AMX_TILES_H
#define AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define AMX_BF16 1
#include "bf16_vectors.h"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...); /* unistd.h declares it only with _GNU_SOURCE, which -std=c11 leaves off */

#define AMX_REQUEST_PERMISSION 0x1023 /* arch_prctl's ARCH_REQ_XCOMP_PERM */
#define AMX_TILE_DATA 18              /* XFEATURE_XTILEDATA */
#define AMX_TILE_ROWS 16
#define AMX_TILE_BYTES 64

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_config;

/* Whether this process may use the tiles (Linux grants them on request; a kernel too old, or a VM
 * that hides them, says no and the callers keep their vector paths). */
static inline int amx_allowed(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused (a race only asks twice) */
    if (state == 0) state = syscall(SYS_arch_prctl, AMX_REQUEST_PERMISSION, AMX_TILE_DATA) == 0 ? 1 : -1;
    return state > 0;
}

/* The tiles on the calling thread (each OpenMP thread loads its own): A tiles (4, 5) and C tiles (0-3)
 * `rows` rows (1-16: the rows of x a block holds), B tiles (6, 7) 16; every row 64 bytes. */
static inline void amx_configure(int rows) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t >= 6 ? AMX_TILE_ROWS : (uint8_t)rows;
        config.bytes_per_row[t] = AMX_TILE_BYTES;
    }
    _tile_loadconfig(&config);
}
#endif

#endif
