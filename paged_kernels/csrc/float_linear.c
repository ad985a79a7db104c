/* Float linear layers (paged_kernels/native_layer_ops.py, worker/runner/prepack.py):
 * out[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]), float32 weights and rows (float_linear_f32), or
 * bfloat16 weights and rows (float_linear_bf16: computed in float32, the output rounded to bfloat16
 * once, as torch's bfloat16 matrix product does).
 *
 * The weights are laid out in panels (NativeLayerOps.float_panels): PANEL output channels side by side,
 * then the inputs, [panels, in, PANEL], so a panel is one stream of lines, a line the PANEL outputs'
 * weights of one input (128 bytes in float32, 64 in bfloat16). An input (broadcast) times a line is
 * two vector multiply-adds into 32 outputs, each output's sum in its own lane: no horizontal sums,
 * and a line read once serves every row of a tile (up to ROWS_AT_ONCE rows: 2 x ROWS_AT_ONCE
 * accumulators in registers).
 *
 * Every output is summed over its inputs in order, one fused multiply-add each (one rounding, as
 * fmaf; bfloat16 values are exact in float32), then the bias added: so a row's result depends on
 * that row alone (one row or a batch, the same bits: the engine's batched output must equal its
 * unbatched one) and on no instruction set (AVX-512, AVX2 and plain C compute the same).
 *
 * bfloat16 on a CPU with AMX (amx_tiles.h) runs on tiles instead, for every row count, where the
 * inputs come in whole tiles (32 of them): the same pair-by-pair products, a row's bits still the same
 * alone or in a batch, but an output may differ from the vector paths' in its last bit (TDPBF16PS
 * rounds its sums its own way), and subnormal sums are flushed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "paged_common.h"

#if defined(__AVX512F__)
#define F32_512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_256 1
#include <immintrin.h>
#endif

#define PANEL 32       /* output channels side by side: one line per input */
#define ROWS_AT_ONCE 8 /* the most rows of x a line serves before the next line is read (tiles of 1 to 8) */
#define ROW_TILE 64    /* rows of x read against every panel before the next rows */
#define PREFETCH 8     /* lines ahead asked of memory: one row alone streams at ~40 GB/s without, ~70 with */

/* float32: sums of one panel's PANEL outputs over all inputs for R rows of x (rows `in` apart):
 * acc[r * PANEL + lane]. */
#if F32_512
/* A tile's accumulators (16 lanes each: outputs 0-15 in a0, 16-31 in a1) to acc[r * PANEL + lane]. */
static inline void store_rows(float *acc, const __m512 *a0, const __m512 *a1, int rows) {
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(acc + r * PANEL, a0[r]);
        _mm512_storeu_ps(acc + r * PANEL + 16, a1[r]);
    }
}

#define PANEL_ROWS(W, WT, R)                                                                           \
    static inline void panel_##W##_##R(const WT *panel, const float *x, int64_t in, float *acc) {       \
        __m512 a0[R], a1[R];                                                                           \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                               \
        for (int64_t k = 0; k < in; k++) {                                                             \
            const WT *line = panel + k * PANEL;                                                        \
            _mm_prefetch((const char *)(line + PREFETCH * PANEL), _MM_HINT_T0);                         \
            _mm_prefetch((const char *)(line + PREFETCH * PANEL) + 64, _MM_HINT_T0);                    \
            const __m512 w0 = _mm512_loadu_ps(line), w1 = _mm512_loadu_ps(line + 16);                                  \
            for (int r = 0; r < R; r++) {                                                              \
                const __m512 v = _mm512_set1_ps(x[r * in + k]);                                        \
                a0[r] = _mm512_fmadd_ps(w0, v, a0[r]);                                                 \
                a1[r] = _mm512_fmadd_ps(w1, v, a1[r]);                                                 \
            }                                                                                          \
        }                                                                                              \
        store_rows(acc, a0, a1, R);                                                                    \
    }
#elif F32_256
#define PANEL_ROWS(W, WT, R)                                                                           \
    static inline void panel_##W##_##R(const WT *panel, const float *x, int64_t in, float *acc) {       \
        for (int r = 0; r < R; r++) {                                                                  \
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
            for (int64_t k = 0; k < in; k++) {                                                         \
                const __m256 v = _mm256_set1_ps(x[r * in + k]);                                        \
                for (int q = 0; q < 4; q++) a[q] = _mm256_fmadd_ps(_mm256_loadu_ps(panel + k * PANEL + q * 8), v, a[q]); \
            }                                                                                          \
            for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc + r * PANEL + q * 8, a[q]);               \
        }                                                                                              \
    }
#else
#define PANEL_ROWS(W, WT, R)                                                                           \
    static inline void panel_##W##_##R(const WT *panel, const float *x, int64_t in, float *acc) {       \
        for (int r = 0; r < R; r++) {                                                                  \
            float a[PANEL] = {0};                                                                      \
            for (int64_t k = 0; k < in; k++)                                                           \
                for (int lane = 0; lane < PANEL; lane++)                                               \
                    a[lane] = fmaf(panel[k * PANEL + lane], x[r * in + k], a[lane]);        \
            memcpy(acc + r * PANEL, a, sizeof a);                                                      \
        }                                                                                              \
    }
#endif
PANEL_ROWS(f32, float, 1)
PANEL_ROWS(f32, float, 2)
PANEL_ROWS(f32, float, 3)
PANEL_ROWS(f32, float, 4)
PANEL_ROWS(f32, float, 5)
PANEL_ROWS(f32, float, 6)
PANEL_ROWS(f32, float, 7)
PANEL_ROWS(f32, float, 8) /* ROWS_AT_ONCE */

/* bfloat16: the weights in pairs of inputs, [panels, ceil(in / 2), PANEL, 2] (a 128-byte line holds
 * two inputs' weights for the PANEL outputs), x in pairs too. Each pair adds, per output, the odd
 * input's product and then the even one's, each a fused multiply-add: what AVX-512 BF16's vdpbf16ps
 * does in one instruction (16 outputs, 32 products), computed the same way elsewhere from the
 * widened values. (vdpbf16ps treats subnormal inputs and results as zero: on a CPU with it, a sum
 * that meets a subnormal may differ in its last bits from the same sum on one without.) */
static inline int32_t pair_at(const uint16_t *x, int64_t j) {
    int32_t pair;
    memcpy(&pair, x + 2 * j, sizeof pair);
    return pair;
}

#if defined(__AVX512BF16__)
static inline __m512 dpbf16(__m512 acc, __m512i w, __m512i x) { /* in place: GCC's intrinsic copies the accumulator */
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}
#define PAIR_STEP(acc, w, x) acc = dpbf16(acc, w, x)
#elif F32_512
static inline __m512 dpbf16(__m512 acc, __m512i w, __m512i x) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), _mm512_castsi512_ps(_mm512_and_si512(x, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc);
}
#define PAIR_STEP(acc, w, x) acc = dpbf16(acc, w, x)
#endif

#if F32_512
#define PAIR_ROWS(R)                                                                                   \
    static inline void pairs_##R(const uint16_t *panel, const uint16_t *x, int64_t pairs, float *acc) { \
        __m512 a0[R], a1[R];                                                                           \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                               \
        for (int64_t j = 0; j < pairs; j++) {                                                          \
            const uint16_t *line = panel + j * 2 * PANEL;                                              \
            _mm_prefetch((const char *)(line + PREFETCH * 2 * PANEL), _MM_HINT_T0);                     \
            _mm_prefetch((const char *)(line + PREFETCH * 2 * PANEL) + 64, _MM_HINT_T0);                \
            const __m512i w0 = _mm512_loadu_si512((const void *)line), w1 = _mm512_loadu_si512((const void *)(line + 32)); \
            for (int r = 0; r < R; r++) {                                                              \
                const __m512i v = _mm512_set1_epi32(pair_at(x + r * 2 * pairs, j));                    \
                PAIR_STEP(a0[r], w0, v);                                                               \
                PAIR_STEP(a1[r], w1, v);                                                               \
            }                                                                                          \
        }                                                                                              \
        store_rows(acc, a0, a1, R);                                                                    \
    }
#elif F32_256
#define PAIR_ROWS(R)                                                                                   \
    static inline void pairs_##R(const uint16_t *panel, const uint16_t *x, int64_t pairs, float *acc) { \
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);                                      \
        for (int r = 0; r < R; r++) {                                                                  \
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
            for (int64_t j = 0; j < pairs; j++) {                                                      \
                const __m256 odd = _mm256_set1_ps(bf16_load(x + r * 2 * pairs + 2 * j + 1));          \
                const __m256 even = _mm256_set1_ps(bf16_load(x + r * 2 * pairs + 2 * j));              \
                for (int q = 0; q < 4; q++) {                                                          \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(panel + j * 2 * PANEL + q * 16)); \
                    a[q] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high)), odd, a[q]); \
                    a[q] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), even, a[q]); \
                }                                                                                      \
            }                                                                                          \
            for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc + r * PANEL + q * 8, a[q]);               \
        }                                                                                              \
    }
#else
#define PAIR_ROWS(R)                                                                                   \
    static inline void pairs_##R(const uint16_t *panel, const uint16_t *x, int64_t pairs, float *acc) { \
        for (int r = 0; r < R; r++) {                                                                  \
            float a[PANEL] = {0};                                                                      \
            for (int64_t j = 0; j < pairs; j++) {                                                      \
                const float odd = bf16_load(x + r * 2 * pairs + 2 * j + 1), even = bf16_load(x + r * 2 * pairs + 2 * j); \
                for (int lane = 0; lane < PANEL; lane++) {                                             \
                    a[lane] = fmaf(bf16_load(panel + j * 2 * PANEL + 2 * lane + 1), odd, a[lane]);     \
                    a[lane] = fmaf(bf16_load(panel + j * 2 * PANEL + 2 * lane), even, a[lane]);        \
                }                                                                                      \
            }                                                                                          \
            memcpy(acc + r * PANEL, a, sizeof a);                                                      \
        }                                                                                              \
    }
#endif
PAIR_ROWS(1)
PAIR_ROWS(2)
PAIR_ROWS(3)
PAIR_ROWS(4)
PAIR_ROWS(5)
PAIR_ROWS(6)
PAIR_ROWS(7)
PAIR_ROWS(8)

/* The panels' tiles of rows, for one panel: up to 8 rows at a time, a tile of every size so that a
 * step of 2-7 rows (draft tokens being checked, a short chunk) reads each line once (PANEL_ROWS, PAIR_ROWS),
 * then each output's sum plus its bias rounded to T. x: float32 rows of `in` (f32) or bfloat16 rows of
 * 2 * `steps` (bf16, padded to whole pairs). */
#define PANEL_TILES(W, T, STEP_FN, XT, XSTRIDE, LOAD, STORE)                               \
    static void tiles_##W(const T *panel, const XT *x, int64_t steps, const T *bias, T *out, int64_t first, \
                          int64_t last, int64_t n0, int64_t width, int64_t outs) {                     \
        float acc[ROWS_AT_ONCE * PANEL];                                                               \
        for (int64_t r = first; r < last;) {                                                           \
            const int tile = last - r >= ROWS_AT_ONCE ? ROWS_AT_ONCE : (int)(last - r);               \
            const XT *rows = x + r * (XSTRIDE);                                                        \
            switch (tile) {                                                                            \
            case 8: STEP_FN##_8(panel, rows, steps, acc); break;                                       \
            case 7: STEP_FN##_7(panel, rows, steps, acc); break;                                       \
            case 6: STEP_FN##_6(panel, rows, steps, acc); break;                                       \
            case 5: STEP_FN##_5(panel, rows, steps, acc); break;                                       \
            case 4: STEP_FN##_4(panel, rows, steps, acc); break;                                       \
            case 3: STEP_FN##_3(panel, rows, steps, acc); break;                                       \
            case 2: STEP_FN##_2(panel, rows, steps, acc); break;                                       \
            default: STEP_FN##_1(panel, rows, steps, acc);                                             \
            }                                                                                          \
            for (int i = 0; i < tile; i++)                                                             \
                for (int lane = 0; lane < width; lane++) {                                             \
                    float v = acc[i * PANEL + lane];                                                   \
                    if (bias != NULL) v += LOAD(bias + n0 + lane);                                     \
                    STORE(out + (r + i) * outs + n0 + lane, v);                                        \
                }                                                                                      \
            r += tile;                                                                                 \
        }                                                                                              \
    }
PANEL_TILES(f32, float, panel_f32, float, steps, f32_load, f32_store)
PANEL_TILES(bf16, uint16_t, pairs, uint16_t, 2 * steps, bf16_load, bf16_store)

/* x [rows, in] packed; panels as above; bias [outs] or NULL; out [rows, outs]; all at one type.
 * bfloat16 rows of an odd width are copied padded to whole pairs first: returns 0, or -1 where that
 * scratch could not be had (the caller falls back). */
int float_linear_f32(const float *x, const float *panels, const float *bias, float *out, int64_t rows, int64_t in,
                     int64_t outs, int64_t npanels, int threads) {
    for (int64_t first = 0; first < rows; first += ROW_TILE) { /* a tile of rows stays in cache */
        const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t p = 0; p < npanels; p++) {
            const int64_t n0 = p * PANEL;
            tiles_f32(panels + p * in * PANEL, x, in, bias, out, first, last, n0, outs - n0 < PANEL ? outs - n0 : PANEL,
                      outs);
        }
    }
    return 0;
}

#if AMX_BF16
/* bfloat16 on AMX tiles: the panels' pair layout is a B tile's (a tile's row: 16 outputs' pairs of one
 * pair of inputs, half a line), so a panel is read as two B tiles per 16 pairs with no reordering, and
 * an A tile is 16 rows of x as they are. One row streams the weights as fast as the vector path; 64
 * rows cost ~1.8x one row where the vector path's cost ~5x (8,960 x 1,536 on a 2-core Xeon: 0.50 and
 * 0.88 ms). Used for every row count where it runs (amx_tiles.h says why). */
#define AMX_PAIRS 16       /* pairs of inputs per B tile */
#define AMX_ROW_BLOCK 32   /* rows of x against one panel at a time (two A tiles, four C tiles) */
#define AMX_ROW_CHUNK 512  /* rows of x read against every panel before the next rows */
#define AMX_PREFETCH_PAIRS 64 /* the panel's lines this many pairs ahead asked of memory while the tiles multiply */

/* acc[r * PANEL + lane] = the sums of one panel's outputs for 32 (TWO) or up to 16 rows of x (as many as
 * the A and C tiles are configured to). */
#define AMX_PANEL(NAME, TWO)                                                                          \
    static void NAME(const uint16_t *panel, const uint16_t *x, int64_t pairs, float *acc) {           \
        const size_t row_bytes = (size_t)pairs * 4, line_bytes = 2 * PANEL * sizeof *panel;          \
        _tile_zero(0);                                                                                \
        _tile_zero(1);                                                                                \
        if (TWO) {                                                                                    \
            _tile_zero(2);                                                                            \
            _tile_zero(3);                                                                            \
        }                                                                                             \
        for (int64_t j = 0; j < pairs; j += AMX_PAIRS) {                                              \
            const char *ahead = (const char *)(panel + (j + AMX_PREFETCH_PAIRS) * 2 * PANEL);           \
            for (int line = 0; line < AMX_PAIRS * (int)line_bytes; line += 64)                        \
                _mm_prefetch(ahead + line, _MM_HINT_T0);                                              \
            _tile_loadd(6, panel + j * 2 * PANEL, line_bytes);                                        \
            _tile_loadd(7, panel + j * 2 * PANEL + PANEL, line_bytes);                                \
            _tile_loadd(4, x + 2 * j, row_bytes);                                                     \
            _tile_dpbf16ps(0, 4, 6);                                                                  \
            _tile_dpbf16ps(1, 4, 7);                                                                  \
            if (TWO) {                                                                                \
                _tile_loadd(5, x + AMX_TILE_ROWS * 2 * pairs + 2 * j, row_bytes);                     \
                _tile_dpbf16ps(2, 5, 6);                                                              \
                _tile_dpbf16ps(3, 5, 7);                                                              \
            }                                                                                         \
        }                                                                                             \
        _tile_stored(0, acc, PANEL * sizeof *acc);                                                    \
        _tile_stored(1, acc + 16, PANEL * sizeof *acc);                                               \
        if (TWO) {                                                                                    \
            _tile_stored(2, acc + AMX_TILE_ROWS * PANEL, PANEL * sizeof *acc);                        \
            _tile_stored(3, acc + AMX_TILE_ROWS * PANEL + 16, PANEL * sizeof *acc);                   \
        }                                                                                             \
    }
AMX_PANEL(amx_panel_32, 1)
AMX_PANEL(amx_panel_16, 0)

/* `rows` rows of a panel's sums (acc[r * PANEL + lane]), plus the bias where given, rounded to bf16
 * (vcvtne2ps2bf16: to nearest even, as bf16_store; subnormals flushed, as the tiles flush them) into
 * out[r * outs + lane] for the panel's `width` outputs: a row in a few instructions (written a value
 * at a time, the stores cost twice the tiles' products at 1,536 inputs). */
static void amx_rows_out(const float *acc, int64_t rows, int64_t width, const uint16_t *bias, uint16_t *out,
                         int64_t outs) {
    const __mmask32 lanes = width >= PANEL ? 0xffffffffu : (1u << width) - 1;
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias != NULL) {
        const __m512i raw = _mm512_maskz_loadu_epi16(lanes, bias);
        b0 = bf16x16(_mm512_castsi512_si256(raw));
        b1 = bf16x16(_mm512_extracti64x4_epi64(raw, 1));
    }
    for (int64_t r = 0; r < rows; r++) {
        __m512 v0 = _mm512_loadu_ps(acc + r * PANEL), v1 = _mm512_loadu_ps(acc + r * PANEL + 16);
        if (bias != NULL) { /* no bias: nothing added (-0.0 stays -0.0) */
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        _mm512_mask_storeu_epi16(out + r * outs, lanes, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
}

/* x [rows, 2 * pairs] (pairs a whole number of tiles). Blocks of 32 and 16 rows, then the rest (1-15
 * rows) on tiles configured to that many rows, so no row is read past the end of x. */
static void float_linear_bf16_amx(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *out,
                                  int64_t rows, int64_t pairs, int64_t outs, int64_t npanels, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float acc[AMX_ROW_BLOCK * PANEL];
        amx_configure(AMX_TILE_ROWS);
        for (int64_t first = 0; first < rows; first += AMX_ROW_CHUNK) {
            const int64_t last = first + AMX_ROW_CHUNK < rows ? first + AMX_ROW_CHUNK : rows;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < npanels; p++) {
                const int64_t n0 = p * PANEL, width = outs - n0 < PANEL ? outs - n0 : PANEL;
                const uint16_t *panel = panels + p * pairs * 2 * PANEL;
                for (int64_t r0 = first; r0 < last;) {
                    const int64_t block = last - r0 >= AMX_ROW_BLOCK ? AMX_ROW_BLOCK
                                          : last - r0 >= AMX_TILE_ROWS ? AMX_TILE_ROWS : last - r0;
                    if (block < AMX_TILE_ROWS) amx_configure((int)block);
                    (block == AMX_ROW_BLOCK ? amx_panel_32 : amx_panel_16)(panel, x + r0 * 2 * pairs, pairs, acc);
                    if (block < AMX_TILE_ROWS) amx_configure(AMX_TILE_ROWS);
                    amx_rows_out(acc, block, width, bias != NULL ? bias + n0 : NULL, out + r0 * outs + n0, outs);
                    r0 += block;
                }
            }
        }
        _tile_release();
    }
}
#endif

int float_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *out, int64_t rows,
                      int64_t in, int64_t outs, int64_t npanels, int threads) {
    const int64_t pairs = (in + 1) / 2;
#if AMX_BF16
    if (pairs % AMX_PAIRS == 0 && amx_allowed()) { /* every row count, so a row's bits do not depend on its batch */
        float_linear_bf16_amx(x, panels, bias, out, rows, pairs, outs, npanels, threads);
        return 0;
    }
#endif
    uint16_t *padded = NULL;
    if (in % 2) {
        padded = malloc((size_t)(rows * 2 * pairs) * sizeof *padded);
        if (padded == NULL && rows > 0) return -1;
        for (int64_t r = 0; r < rows; r++) {
            memcpy(padded + r * 2 * pairs, x + r * in, (size_t)in * sizeof *x);
            padded[r * 2 * pairs + in] = 0;
        }
        x = padded;
    }
    for (int64_t first = 0; first < rows; first += ROW_TILE) {
        const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t p = 0; p < npanels; p++) {
            const int64_t n0 = p * PANEL;
            tiles_bf16(panels + p * pairs * 2 * PANEL, x, pairs, bias, out, first, last, n0,
                       outs - n0 < PANEL ? outs - n0 : PANEL, outs);
        }
    }
    free(padded);
    return 0;
}
