/* A float32 linear layer (paged_kernels/native_layer_ops.py, worker/runner/prepack.py):
 * out[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]).
 *
 * The weights are laid out in panels (NativeLayerOps.f32_panels): PANEL output channels side by side,
 * then the inputs, [panels, in, PANEL], so a panel is one stream of 128-byte lines, a line the PANEL
 * outputs' weights of one input. An input (broadcast) times a line is two vector multiply-adds into
 * 32 outputs, each output's sum in its own lane: no horizontal sums, and a line read once serves
 * every row of a tile (ROWS_AT_ONCE rows: 2 x ROWS_AT_ONCE accumulators in registers).
 *
 * Every output is summed over its inputs in order, one fused multiply-add each (one rounding, as
 * fmaf), then the bias added: so a row's result depends on that row alone (one row or a batch, the
 * same bits: the engine's batched output must equal its unbatched one) and on no instruction set
 * (AVX-512, AVX2 and plain C compute the same; plain C through fmaf).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define F32_512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_256 1
#include <immintrin.h>
#endif

#define PANEL 32       /* output channels side by side: one 128-byte line per input */
#define ROWS_AT_ONCE 8 /* the most rows of x a line serves before the next line is read (tiles of 8, 4, 1) */
#define ROW_TILE 64    /* rows of x read against every panel before the next rows */
#define PREFETCH 8     /* lines ahead asked of memory: one row alone streams at ~40 GB/s without, ~70 with */

/* Sums of one panel's PANEL outputs over all inputs for `rows` (<= ROWS_AT_ONCE) rows of x (rows
 * `in` apart): acc[r * PANEL + lane]. */
#if F32_512
#define PANEL_ROWS(R)                                                                                  \
    static inline void panel_rows_##R(const float *panel, const float *x, int64_t in, float *acc) {     \
        __m512 a0[R], a1[R];                                                                           \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                               \
        for (int64_t k = 0; k < in; k++) {                                                             \
            _mm_prefetch((const char *)(panel + (k + PREFETCH) * PANEL), _MM_HINT_T0);                  \
            _mm_prefetch((const char *)(panel + (k + PREFETCH) * PANEL + 16), _MM_HINT_T0);             \
            const __m512 w0 = _mm512_loadu_ps(panel + k * PANEL), w1 = _mm512_loadu_ps(panel + k * PANEL + 16); \
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
#define PANEL_ROWS(R)                                                                                  \
    static inline void panel_rows_##R(const float *panel, const float *x, int64_t in, float *acc) {     \
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
#define PANEL_ROWS(R)                                                                                  \
    static inline void panel_rows_##R(const float *panel, const float *x, int64_t in, float *acc) {     \
        for (int r = 0; r < R; r++) {                                                                  \
            float a[PANEL] = {0};                                                                      \
            for (int64_t k = 0; k < in; k++)                                                           \
                for (int lane = 0; lane < PANEL; lane++) a[lane] = fmaf(panel[k * PANEL + lane], x[r * in + k], a[lane]); \
            memcpy(acc + r * PANEL, a, sizeof a);                                                      \
        }                                                                                              \
    }
#endif
PANEL_ROWS(1)
PANEL_ROWS(4)
PANEL_ROWS(8) /* ROWS_AT_ONCE */

/* panels: float32 [npanels, in, PANEL], outs <= npanels * PANEL; x [rows, in] packed; bias [outs] or
 * NULL; out [rows, outs]. */
void f32_linear(const float *x, const float *panels, const float *bias, float *out, int64_t rows, int64_t in,
                int64_t outs, int64_t npanels, int threads) {
    for (int64_t first = 0; first < rows; first += ROW_TILE) { /* a tile of rows stays in cache */
        const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t p = 0; p < npanels; p++) {
            const int64_t n0 = p * PANEL, width = outs - n0 < PANEL ? outs - n0 : PANEL;
            const float *panel = panels + p * in * PANEL;
            float acc[ROWS_AT_ONCE * PANEL];
            for (int64_t r = first; r < last;) {
                const int tile = last - r >= 8 ? 8 : (last - r >= 4 ? 4 : 1);
                if (tile == 8)
                    panel_rows_8(panel, x + r * in, in, acc);
                else if (tile == 4)
                    panel_rows_4(panel, x + r * in, in, acc);
                else
                    panel_rows_1(panel, x + r * in, in, acc);
                for (int i = 0; i < tile; i++) {
                    float *row = out + (r + i) * outs + n0;
                    memcpy(row, acc + i * PANEL, (size_t)width * sizeof *row);
                    if (bias != NULL)
                        for (int lane = 0; lane < width; lane++) row[lane] += bias[n0 + lane];
                }
                r += tile;
            }
        }
    }
}
