/* A weight-only int8 linear layer (paged_kernels/native_layer_ops.py, worker/runner/quantized_linear.py):
 * out[m, n] = scale[n] * sum_k codes[n, k] * x[m, k] (+ bias[n]), int8 codes with a bfloat16 scale
 * per output channel.
 *
 * Each row of x is taken to int16 in groups of GROUP values (absmax / 32767 per group: every value
 * within 1/65534 of its group's largest, finer than the bfloat16 rounding torch's int8 kernel needs),
 * so a group's sum of products is integer arithmetic, exact in int32 (GROUP x 127 x 32767 < 2^31),
 * and the same whatever the instruction set adds it with. Groups are then summed in float in their
 * order, each with one fused multiply-add (one rounding, as fmaf). So a row's result depends on that
 * row alone and on no instruction set: the same for one row or a batch, on any CPU (the engine's
 * batched output must equal its unbatched one).
 *
 * The codes are laid out in panels (NativeLayerOps.int8_panels): PANEL output channels side by side,
 * then pairs of inputs, [panels, in / 2, PANEL, 2], so a panel is one stream of 64-byte lines, a line
 * the PANEL outputs' codes of one pair of inputs. One vector instruction multiplies a pair of inputs
 * (broadcast) into 16 outputs at once, 32 products with AVX-512 VNNI (vpdpwssd), 16 into 8 outputs
 * with AVX2 (vpmaddwd), each output's sum in its own lane: no horizontal sum per group and output, and
 * a widened weight serves every row of a tile.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define AVX2FMA 1
#include <immintrin.h>
#endif

#define GROUP 256      /* inputs per int16 scale of a row of x */
#define PANEL 32       /* output channels side by side in the codes' layout: a 64-byte line per pair */
#define LINE (2 * PANEL)
#define ROW_TILE 64    /* rows of x (int16) read against every panel before the next rows */
#define ROWS_AT_ONCE 4 /* rows of a tile's inner kernel */

/* Inputs j * 2 and j * 2 + 1 of an int16 row as one 32-bit lane (what a pair instruction multiplies). */
static inline int32_t pair_at(const int16_t *xq, int64_t j) {
    int32_t pair;
    memcpy(&pair, xq + 2 * j, sizeof pair);
    return pair;
}

/* The pairs of group g: [lo, hi). */
#define GROUP_PAIRS(g, pairs) const int64_t lo = (g) * (GROUP / 2), hi = lo + GROUP / 2 < (pairs) ? lo + GROUP / 2 : (pairs)

/* Float sums of a panel's PANEL outputs for `rows` rows: acc[r * PANEL + lane] = sum over groups, in
 * order, of fmaf(integer group sum, the row's group scale, acc). xq rows are `pairs` pairs of int16
 * inputs long; xs holds `groups` scales per row. */
#if VNNI512
/* acc + the pairwise products of a and b, in place: GCC's intrinsic copies the accumulator to a
 * fresh register and back around every vpdpwssd, which doubles the inner loops' instructions. */
static inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

static inline __m512i widened(const int8_t *codes) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)codes));
}

/* One row: each half's pairs split over two accumulators (four chains in flight; integer sums, so the
 * split changes no bit). */
static inline void panel_row(const int8_t *panel, const int16_t *xq, const float *xs, int64_t pairs, int64_t groups,
                             float *acc) {
    __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        GROUP_PAIRS(g, pairs);
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
        int64_t j = lo;
        for (; j + 2 <= hi; j += 2) {
            const int8_t *line = panel + j * LINE;
            const __m512i x = _mm512_set1_epi32(pair_at(xq, j)), y = _mm512_set1_epi32(pair_at(xq, j + 1));
            a0 = dpwssd(a0, widened(line), x);
            a1 = dpwssd(a1, widened(line + 32), x);
            b0 = dpwssd(b0, widened(line + LINE), y);
            b1 = dpwssd(b1, widened(line + LINE + 32), y);
        }
        if (j < hi) {
            const __m512i x = _mm512_set1_epi32(pair_at(xq, j));
            a0 = dpwssd(a0, widened(panel + j * LINE), x);
            a1 = dpwssd(a1, widened(panel + j * LINE + 32), x);
        }
        const __m512 s = _mm512_set1_ps(xs[g]);
        f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, b0)), s, f0);
        f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a1, b1)), s, f1);
    }
    _mm512_storeu_ps(acc, f0);
    _mm512_storeu_ps(acc + 16, f1);
}

/* ROWS_AT_ONCE rows: each widened line serves them all (2 x ROWS_AT_ONCE chains in flight). */
static inline void panel_rows(const int8_t *panel, const int16_t *xq, const float *xs, int64_t pairs, int64_t groups,
                              float *acc) {
    __m512 f0[ROWS_AT_ONCE], f1[ROWS_AT_ONCE];
    for (int r = 0; r < ROWS_AT_ONCE; r++) f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        GROUP_PAIRS(g, pairs);
        __m512i a0[ROWS_AT_ONCE], a1[ROWS_AT_ONCE];
        for (int r = 0; r < ROWS_AT_ONCE; r++) a0[r] = a1[r] = _mm512_setzero_si512();
        for (int64_t j = lo; j < hi; j++) {
            const __m512i w0 = widened(panel + j * LINE), w1 = widened(panel + j * LINE + 32);
            for (int r = 0; r < ROWS_AT_ONCE; r++) {
                const __m512i x = _mm512_set1_epi32(pair_at(xq + r * 2 * pairs, j));
                a0[r] = dpwssd(a0[r], w0, x);
                a1[r] = dpwssd(a1[r], w1, x);
            }
        }
        for (int r = 0; r < ROWS_AT_ONCE; r++) {
            const __m512 s = _mm512_set1_ps(xs[r * groups + g]);
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), s, f0[r]);
            f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[r]), s, f1[r]);
        }
    }
    for (int r = 0; r < ROWS_AT_ONCE; r++) {
        _mm512_storeu_ps(acc + r * PANEL, f0[r]);
        _mm512_storeu_ps(acc + r * PANEL + 16, f1[r]);
    }
}

static inline void panel_sums(const int8_t *panel, const int16_t *xq, const float *xs, int64_t pairs, int64_t groups,
                              int rows, float *acc) {
    if (rows == ROWS_AT_ONCE)
        panel_rows(panel, xq, xs, pairs, groups, acc);
    else
        for (int r = 0; r < rows; r++) panel_row(panel, xq + r * 2 * pairs, xs + r * groups, pairs, groups, acc + r * PANEL);
}
#else
/* One row at a time: with AVX2 four quarters of 8 lanes (vpmaddwd and an add each), else plain C. */
static inline void panel_row(const int8_t *panel, const int16_t *xq, const float *xs, int64_t pairs, int64_t groups,
                             float *acc) {
#if AVX2FMA
    __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        GROUP_PAIRS(g, pairs);
        __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int64_t j = lo; j < hi; j++) {
            const __m256i x = _mm256_set1_epi32(pair_at(xq, j));
            for (int q = 0; q < 4; q++) {
                const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(panel + j * LINE + q * 16)));
                a[q] = _mm256_add_epi32(a[q], _mm256_madd_epi16(w, x));
            }
        }
        const __m256 s = _mm256_set1_ps(xs[g]);
        for (int q = 0; q < 4; q++) f[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[q]), s, f[q]);
    }
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc + q * 8, f[q]);
#else
    for (int lane = 0; lane < PANEL; lane++) acc[lane] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        GROUP_PAIRS(g, pairs);
        int32_t sums[PANEL] = {0};
        for (int64_t j = lo; j < hi; j++) {
            const int16_t *x = xq + 2 * j;
            const int8_t *line = panel + j * LINE;
            for (int lane = 0; lane < PANEL; lane++)
                sums[lane] += (int32_t)line[lane * 2] * x[0] + (int32_t)line[lane * 2 + 1] * x[1];
        }
        for (int lane = 0; lane < PANEL; lane++) acc[lane] = fmaf((float)sums[lane], xs[g], acc[lane]);
    }
#endif
}

static inline void panel_sums(const int8_t *panel, const int16_t *xq, const float *xs, int64_t pairs, int64_t groups,
                              int rows, float *acc) {
    for (int r = 0; r < rows; r++) panel_row(panel, xq + r * 2 * pairs, xs + r * groups, pairs, groups, acc + r * PANEL);
}
#endif

/* x [rows, in] -> int16 codes [rows, 2 * pairs] (an odd width's last one zero) and a float scale
 * per (row, group). */
#define QUANTIZE_ROWS(NAME, T, LOAD)                                                                   \
    static void NAME(const T *x, int16_t *xq, float *xs, int64_t rows, int64_t in, int64_t pairs,     \
                     int64_t groups) {                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            int16_t *q = xq + r * 2 * pairs;                                                          \
            q[2 * pairs - 1] = 0;                                                                     \
            for (int64_t g = 0; g < groups; g++) {                                                    \
                const int64_t start = g * GROUP, end = start + GROUP < in ? start + GROUP : in;       \
                float top = 0.0f;                                                                     \
                for (int64_t k = start; k < end; k++) top = fmaxf(top, fabsf(LOAD(x + r * in + k)));  \
                const float scale = top > 0.0f ? top / 32767.0f : 1.0f;                               \
                const float inv = 1.0f / scale;                                                       \
                xs[r * groups + g] = scale;                                                           \
                for (int64_t k = start; k < end; k++) {                                               \
                    const float v = nearbyintf(LOAD(x + r * in + k) * inv);                          \
                    q[k] = (int16_t)(v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v));      \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

/* panels: int8 [npanels, pairs, PANEL, 2], pairs = ceil(in / 2), outs <= npanels * PANEL. Returns 0,
 * or -1 where the scratch for the int16 rows could not be had (the caller falls back). */
#define INT8_LINEAR(NAME, T, LOAD, STORE, QUANTIZE)                                                    \
    QUANTIZE_ROWS(QUANTIZE, T, LOAD)                                                                  \
    int NAME(const T *x, const int8_t *panels, const uint16_t *scale, const T *bias, T *out, int64_t rows, \
             int64_t in, int64_t outs, int64_t npanels, int threads) {                                \
        const int64_t groups = (in + GROUP - 1) / GROUP, pairs = (in + 1) / 2;                        \
        int16_t *xq = malloc((size_t)(rows * 2 * pairs) * sizeof *xq);                                \
        float *xs = malloc((size_t)(rows * groups) * sizeof *xs);                                     \
        if (xq == NULL || xs == NULL) {                                                               \
            free(xq);                                                                                 \
            free(xs);                                                                                 \
            return -1;                                                                                \
        }                                                                                             \
        QUANTIZE(x, xq, xs, rows, in, pairs, groups);                                                 \
        for (int64_t first = 0; first < rows; first += ROW_TILE) { /* a tile of rows stays in cache */ \
            const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;                   \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
            for (int64_t p = 0; p < npanels; p++) {                                                   \
                const int64_t n0 = p * PANEL, width = outs - n0 < PANEL ? outs - n0 : PANEL;          \
                float acc[ROWS_AT_ONCE * PANEL], s[PANEL], b[PANEL];                                  \
                for (int lane = 0; lane < width; lane++) {                                            \
                    s[lane] = bf16_load(scale + n0 + lane);                                           \
                    b[lane] = bias != NULL ? LOAD(bias + n0 + lane) : 0.0f;                           \
                }                                                                                     \
                for (int64_t r = first; r < last; r += ROWS_AT_ONCE) {                                \
                    const int tile = last - r < ROWS_AT_ONCE ? (int)(last - r) : ROWS_AT_ONCE;         \
                    panel_sums(panels + p * pairs * LINE, xq + r * 2 * pairs, xs + r * groups, pairs,  \
                               groups, tile, acc);                                                    \
                    for (int i = 0; i < tile; i++)                                                    \
                        for (int lane = 0; lane < width; lane++)                                      \
                            STORE(out + (r + i) * outs + n0 + lane, fmaf(acc[i * PANEL + lane], s[lane], b[lane])); \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        free(xq);                                                                                     \
        free(xs);                                                                                     \
        return 0;                                                                                     \
    }

INT8_LINEAR(int8_linear_f32, float, f32_load, f32_store, quantize_rows_f32)
INT8_LINEAR(int8_linear_bf16, uint16_t, bf16_load, bf16_store, quantize_rows_bf16)
