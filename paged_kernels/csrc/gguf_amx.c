/* A batch of bfloat16 rows times a GGUF file's quantized matrix on AMX tiles (csrc/gguf_linear.c's
 * gguf_linear_bf16 hands over a batch of GGUF_AMX_ROWS rows or more, where the CPU has the tiles).
 *
 * Each thread takes 32 output rows at a time: their blocks decoded to bfloat16 (gguf_dequantize_rows_bf16,
 * the decode a batch's GEMM and the embedding lookups use: the weight rounded to bf16 as transformers'
 * bf16 reading of the file rounds it) into a buffer of 32 x `in` (at most ~0.6 MB at 8,960 inputs: the
 * L2 cache), then multiplied with the whole batch there: an A tile is 16 decoded weight rows' 32
 * inputs as decoded, a B tile the batch's 16 rows' same inputs in pairs (x laid out once per call, as
 * csrc/float_linear.c lays out a weight), a C tile the 16 x 16 sums, transposed into `out` at the end.
 * The weights are read from memory once per call and decoded once, whatever the batch: where the
 * int16 row kernel decodes each super-block once per 16 rows and multiplies per row, and the decoded
 * GEMM writes every decoded matrix to memory and reads it back.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "paged_common.h"

#if AMX_BF16
#define GROUP 32 /* output rows decoded at a time: two A tiles */
#define BLOCK 32 /* rows of x per pass: two B tiles, four C tiles */

void gguf_dequantize_rows_bf16(const uint8_t *wq, int type, const int64_t *ids, int64_t n, int64_t in, uint16_t *out,
                               int threads);

/* x [rows, in] in pairs per block of BLOCK rows: xt[block][in / 2][BLOCK][2], rows past the end zero. */
static void pair_rows(const uint16_t *x, int64_t rows, int64_t in, uint16_t *xt) {
    const int64_t blocks = (rows + BLOCK - 1) / BLOCK, pairs = in / 2;
    memset(xt, 0, (size_t)(blocks * BLOCK * in) * sizeof *xt);
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = xt + (r / BLOCK) * BLOCK * in + (r % BLOCK) * 2;
        for (int64_t j = 0; j < pairs; j++) memcpy(dst + j * 2 * BLOCK, x + r * in + 2 * j, 2 * sizeof *x);
    }
}

/* sums[o * BLOCK + m] for GROUP decoded rows w [GROUP, in] against one block of paired rows. */
static void group_block(const uint16_t *w, const uint16_t *xt, int64_t in, int two, float *sums) {
    const size_t w_bytes = (size_t)in * sizeof *w, x_bytes = 2 * BLOCK * sizeof *xt;
    _tile_zero(0);
    _tile_zero(2);
    if (two) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < in; k += 2 * AMX_TILE_ROWS) { /* 32 inputs: 16 pairs */
        _tile_loadd(4, w + k, w_bytes);
        _tile_loadd(5, w + AMX_TILE_ROWS * in + k, w_bytes);
        _tile_loadd(6, xt + k * BLOCK, x_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, xt + k * BLOCK + AMX_TILE_ROWS * 2, x_bytes);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    const size_t s_bytes = BLOCK * sizeof *sums;
    _tile_stored(0, sums, s_bytes);
    _tile_stored(2, sums + AMX_TILE_ROWS * BLOCK, s_bytes);
    if (two) {
        _tile_stored(1, sums + AMX_TILE_ROWS, s_bytes);
        _tile_stored(3, sums + AMX_TILE_ROWS * BLOCK + AMX_TILE_ROWS, s_bytes);
    }
}

/* gguf_linear_bf16's contract (in a multiple of 256, a type it runs); 0, or -1 without scratch memory. */
int gguf_linear_amx(const uint16_t *x, const uint8_t *wq, int type, int64_t row_bytes, const uint16_t *bias,
                    uint16_t *out, int64_t rows, int64_t in, int64_t outs, int64_t out_stride, int threads) {
    const int64_t blocks = (rows + BLOCK - 1) / BLOCK, groups = (outs + GROUP - 1) / GROUP;
    uint16_t *xt = malloc((size_t)(blocks * BLOCK * in) * sizeof *xt);
    uint16_t *decoded = malloc((size_t)(threads * GROUP * in) * sizeof *decoded);
    if (xt == NULL || decoded == NULL) {
        free(xt);
        free(decoded);
        return -1;
    }
    pair_rows(x, rows, in, xt);
#pragma omp parallel num_threads(threads)
    {
        uint16_t *w = decoded + (int64_t)omp_get_thread_num() * GROUP * in;
        float sums[GROUP * BLOCK];
        amx_configure(AMX_TILE_ROWS);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * GROUP, count = outs - n0 < GROUP ? outs - n0 : GROUP;
            gguf_dequantize_rows_bf16(wq + n0 * row_bytes, type, NULL, count, in, w, 1); /* rows past count: unused sums */
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t first = b * BLOCK, last = first + BLOCK < rows ? first + BLOCK : rows;
                group_block(w, xt + b * BLOCK * in, in, last - first > AMX_TILE_ROWS, sums);
                for (int64_t r = first; r < last; r++)
                    for (int64_t o = 0; o < count; o++) {
                        float v = sums[o * BLOCK + (r - first)];
                        if (bias != NULL) v += bf16_load(bias + n0 + o);
                        bf16_store(out + r * out_stride + n0 + o, v);
                    }
            }
        }
        _tile_release();
    }
    free(xt);
    free(decoded);
    return 0;
}
#endif
