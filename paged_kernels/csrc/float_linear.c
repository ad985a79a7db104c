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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_common.h"

#if defined(__AVX512F__)
#define F32_512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_256 1
#include <immintrin.h>
#endif

#define PANEL 32       /* output channels side by side: one line per input */
#define ROWS_AT_ONCE 8 /* the most rows of x a line serves before the next line is read (tiles of 8, 4, 1) */
#define ROW_TILE 64    /* rows of x read against every panel before the next rows */
#define PREFETCH 8     /* lines ahead asked of memory: one row alone streams at ~40 GB/s without, ~70 with */

/* 16 (AVX-512) or 8 (AVX2) weights as float32: loaded, or bfloat16 widened (its bits shifted up). */
#if F32_512
static inline __m512 w16_f32(const float *w) { return _mm512_loadu_ps(w); }
static inline __m512 w16_bf16(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
#elif F32_256
static inline __m256 w8_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline __m256 w8_bf16(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
#endif

/* Sums of one panel's PANEL outputs over all inputs for R rows of float32 x (rows `in` apart):
 * acc[r * PANEL + lane]. W: the weights' type (f32 or bf16, its loaders above). */
#if F32_512
#define PANEL_ROWS(W, WT, R)                                                                           \
    static inline void panel_##W##_##R(const WT *panel, const float *x, int64_t in, float *acc) {       \
        __m512 a0[R], a1[R];                                                                           \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                               \
        for (int64_t k = 0; k < in; k++) {                                                             \
            const WT *line = panel + k * PANEL;                                                        \
            _mm_prefetch((const char *)(line + PREFETCH * PANEL), _MM_HINT_T0);                         \
            _mm_prefetch((const char *)(line + PREFETCH * PANEL) + 64, _MM_HINT_T0);                    \
            const __m512 w0 = w16_##W(line), w1 = w16_##W(line + 16);                                  \
            for (int r = 0; r < R; r++) {                                                              \
                const __m512 v = _mm512_set1_ps(x[r * in + k]);                                        \
                a0[r] = _mm512_fmadd_ps(w0, v, a0[r]);                                                 \
                a1[r] = _mm512_fmadd_ps(w1, v, a1[r]);                                                 \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) {                                                                  \
            _mm512_storeu_ps(acc + r * PANEL, a0[r]);                                                  \
            _mm512_storeu_ps(acc + r * PANEL + 16, a1[r]);                                             \
        }                                                                                              \
    }
#elif F32_256
#define PANEL_ROWS(W, WT, R)                                                                           \
    static inline void panel_##W##_##R(const WT *panel, const float *x, int64_t in, float *acc) {       \
        for (int r = 0; r < R; r++) {                                                                  \
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
            for (int64_t k = 0; k < in; k++) {                                                         \
                const __m256 v = _mm256_set1_ps(x[r * in + k]);                                        \
                for (int q = 0; q < 4; q++) a[q] = _mm256_fmadd_ps(w8_##W(panel + k * PANEL + q * 8), v, a[q]); \
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
                    a[lane] = fmaf(W##_load(panel + k * PANEL + lane), x[r * in + k], a[lane]);        \
            memcpy(acc + r * PANEL, a, sizeof a);                                                      \
        }                                                                                              \
    }
#endif
PANEL_ROWS(f32, float, 1)
PANEL_ROWS(f32, float, 4)
PANEL_ROWS(f32, float, 8) /* ROWS_AT_ONCE */
PANEL_ROWS(bf16, uint16_t, 1)
PANEL_ROWS(bf16, uint16_t, 4)
PANEL_ROWS(bf16, uint16_t, 8)

/* x [rows, in] at T, packed; panels [npanels, in, PANEL] at T; bias [outs] at T or NULL; out [rows,
 * outs] at T. Rows of another type than float32 are widened into scratch first: returns 0, or -1
 * where that scratch could not be had (the caller falls back). */
#define FLOAT_LINEAR(NAME, T, W, LOAD, STORE)                                                          \
    int NAME(const T *x, const T *panels, const T *bias, T *out, int64_t rows, int64_t in, int64_t outs, \
             int64_t npanels, int threads) {                                                           \
        float *wide = NULL;                                                                            \
        const float *xf = (const float *)x;                                                            \
        if (sizeof(T) != sizeof(float)) {                                                              \
            wide = malloc((size_t)(rows * in) * sizeof *wide);                                         \
            if (wide == NULL && rows * in > 0) return -1;                                              \
            for (int64_t i = 0; i < rows * in; i++) wide[i] = LOAD(x + i);                             \
            xf = wide;                                                                                 \
        }                                                                                              \
        for (int64_t first = 0; first < rows; first += ROW_TILE) { /* a tile of rows stays in cache */ \
            const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;                    \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
            for (int64_t p = 0; p < npanels; p++) {                                                    \
                const int64_t n0 = p * PANEL, width = outs - n0 < PANEL ? outs - n0 : PANEL;           \
                const T *panel = panels + p * in * PANEL;                                              \
                float acc[ROWS_AT_ONCE * PANEL];                                                       \
                for (int64_t r = first; r < last;) {                                                   \
                    const int tile = last - r >= 8 ? 8 : (last - r >= 4 ? 4 : 1);                     \
                    if (tile == 8)                                                                     \
                        panel_##W##_8(panel, xf + r * in, in, acc);                                    \
                    else if (tile == 4)                                                                \
                        panel_##W##_4(panel, xf + r * in, in, acc);                                    \
                    else                                                                               \
                        panel_##W##_1(panel, xf + r * in, in, acc);                                    \
                    for (int i = 0; i < tile; i++)                                                     \
                        for (int lane = 0; lane < width; lane++) {                                     \
                            float v = acc[i * PANEL + lane];                                           \
                            if (bias != NULL) v += LOAD(bias + n0 + lane);                             \
                            STORE(out + (r + i) * outs + n0 + lane, v);                                \
                        }                                                                              \
                    r += tile;                                                                         \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        free(wide);                                                                                    \
        return 0;                                                                                      \
    }

FLOAT_LINEAR(float_linear_f32, float, f32, f32_load, f32_store)
FLOAT_LINEAR(float_linear_bf16, uint16_t, bf16, bf16_load, bf16_store)
