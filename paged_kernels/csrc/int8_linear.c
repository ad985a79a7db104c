/* A weight-only int8 linear layer (paged_kernels/native_layer_ops.py, worker/runner/quantized_linear.py):
 * out[m, n] = scale[n] * sum_k codes[n, k] * x[m, k] (+ bias[n]), int8 codes with a bfloat16 scale
 * per output channel.
 *
 * Each row of x is taken to int16 in groups of GROUP values (absmax / 32767 per group: every value
 * within 1/65534 of its group's largest, finer than the bfloat16 rounding torch's int8 kernel needs),
 * so a group's sum of products is integer arithmetic, exact in int32 (GROUP x 127 x 32767 < 2^31),
 * and the same whatever the instruction set adds it with: 32 products a step with AVX-512 VNNI
 * (vpdpwssd), 16 with AVX2 (vpmaddwd), one at a time elsewhere. Groups are then summed in float in
 * their order, each with one fused multiply-add (fmaf: one rounding, whether the compiler would have
 * fused it or not). So a row's result depends on that row alone and on no instruction set: the same
 * for one row or a batch, on any CPU (the engine's batched output must equal its unbatched one).
 * In a batch two rows at a time share each widened weight (their integer sums are the same).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "paged_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 256
#define ROW_TILE 32 /* rows of x (int16) read against every output channel before the next rows */

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__)
static inline int32_t lanes_sum(__m256i acc) {
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
    return _mm_cvtsi128_si32(half);
}
#endif

/* One group's exact sum of codes[k] * xq[k]. */
static inline int32_t group_dot(const int8_t *codes, const int16_t *xq, int64_t n) {
    int64_t k = 0;
    int32_t sum = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc = _mm512_setzero_si512();
    for (; k + 32 <= n; k += 32) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + k)));
        acc = _mm512_dpwssd_epi32(acc, w, _mm512_loadu_si512((const void *)(xq + k)));
    }
    sum = _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (; k + 16 <= n; k += 16) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + k)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)(xq + k))));
    }
    sum = lanes_sum(acc);
#endif
    for (; k < n; k++) sum += (int32_t)codes[k] * (int32_t)xq[k];
    return sum;
}

/* group_dot of two rows of x against the same codes, each weight widened once for both (the sums
 * are exact integers, so each is group_dot's to the bit). */
static inline void group_dot2(const int8_t *codes, const int16_t *x0, const int16_t *x1, int64_t n, int32_t *s0,
                              int32_t *s1) {
    int64_t k = 0;
    int32_t sum0 = 0, sum1 = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    for (; k + 32 <= n; k += 32) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + k)));
        acc0 = _mm512_dpwssd_epi32(acc0, w, _mm512_loadu_si512((const void *)(x0 + k)));
        acc1 = _mm512_dpwssd_epi32(acc1, w, _mm512_loadu_si512((const void *)(x1 + k)));
    }
    sum0 = _mm512_reduce_add_epi32(acc0);
    sum1 = _mm512_reduce_add_epi32(acc1);
#elif defined(__AVX2__)
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    for (; k + 16 <= n; k += 16) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + k)));
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)(x0 + k))));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)(x1 + k))));
    }
    sum0 = lanes_sum(acc0);
    sum1 = lanes_sum(acc1);
#endif
    for (; k < n; k++) {
        sum0 += (int32_t)codes[k] * (int32_t)x0[k];
        sum1 += (int32_t)codes[k] * (int32_t)x1[k];
    }
    *s0 = sum0;
    *s1 = sum1;
}

/* x [rows, in] -> int16 codes [rows, in] and a float scale per (row, group). */
#define QUANTIZE_ROWS(NAME, T, LOAD)                                                                   \
    static void NAME(const T *x, int16_t *xq, float *xs, int64_t rows, int64_t in, int64_t groups) {  \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            for (int64_t g = 0; g < groups; g++) {                                                    \
                const int64_t start = g * GROUP, end = start + GROUP < in ? start + GROUP : in;       \
                float top = 0.0f;                                                                     \
                for (int64_t k = start; k < end; k++) top = fmaxf(top, fabsf(LOAD(x + r * in + k)));  \
                const float scale = top > 0.0f ? top / 32767.0f : 1.0f;                               \
                const float inv = 1.0f / scale;                                                       \
                xs[r * groups + g] = scale;                                                           \
                for (int64_t k = start; k < end; k++) {                                               \
                    const float q = nearbyintf(LOAD(x + r * in + k) * inv);                          \
                    xq[r * in + k] = (int16_t)(q > 32767.0f ? 32767.0f : (q < -32767.0f ? -32767.0f : q)); \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

/* Returns 0, or -1 where the scratch for the int16 rows could not be had (the caller falls back). */
#define INT8_LINEAR(NAME, T, LOAD, STORE, QUANTIZE)                                                    \
    QUANTIZE_ROWS(QUANTIZE, T, LOAD)                                                                  \
    int NAME(const T *x, const int8_t *codes, const uint16_t *scale, const T *bias, T *out, int64_t rows, \
             int64_t in, int64_t outs, int threads) {                                                 \
        const int64_t groups = (in + GROUP - 1) / GROUP;                                              \
        int16_t *xq = malloc((size_t)(rows * in) * sizeof *xq);                                       \
        float *xs = malloc((size_t)(rows * groups) * sizeof *xs);                                     \
        if (xq == NULL || xs == NULL) {                                                               \
            free(xq);                                                                                 \
            free(xs);                                                                                 \
            return -1;                                                                                \
        }                                                                                             \
        QUANTIZE(x, xq, xs, rows, in, groups);                                                        \
        for (int64_t first = 0; first < rows; first += ROW_TILE) { /* a tile of rows stays in cache */ \
            const int64_t last = first + ROW_TILE < rows ? first + ROW_TILE : rows;                   \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
            for (int64_t n = 0; n < outs; n++) {                                                      \
                const int8_t *w = codes + n * in;                                                     \
                const float s = bf16_load(scale + n);                                                 \
                const float b = bias != NULL ? LOAD(bias + n) : 0.0f;                                 \
                int64_t r = first;                                                                    \
                for (; r + 1 < last; r += 2) { /* two rows share each widened weight */              \
                    float acc0 = 0.0f, acc1 = 0.0f;                                                   \
                    for (int64_t g = 0; g < groups; g++) {                                            \
                        const int64_t start = g * GROUP, len = start + GROUP < in ? GROUP : in - start; \
                        int32_t s0, s1;                                                               \
                        group_dot2(w + start, xq + r * in + start, xq + (r + 1) * in + start, len, &s0, &s1); \
                        acc0 = fmaf((float)s0, xs[r * groups + g], acc0);                             \
                        acc1 = fmaf((float)s1, xs[(r + 1) * groups + g], acc1);                       \
                    }                                                                                 \
                    STORE(out + r * outs + n, fmaf(acc0, s, b));                                      \
                    STORE(out + (r + 1) * outs + n, fmaf(acc1, s, b));                                \
                }                                                                                     \
                for (; r < last; r++) {                                                               \
                    float acc = 0.0f;                                                                 \
                    for (int64_t g = 0; g < groups; g++) {                                            \
                        const int64_t start = g * GROUP, len = start + GROUP < in ? GROUP : in - start; \
                        acc = fmaf((float)group_dot(w + start, xq + r * in + start, len), xs[r * groups + g], acc); \
                    }                                                                                 \
                    STORE(out + r * outs + n, fmaf(acc, s, b));                                       \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        free(xq);                                                                                     \
        free(xs);                                                                                     \
        return 0;                                                                                     \
    }

INT8_LINEAR(int8_linear_f32, float, f32_load, f32_store, quantize_rows_f32)
INT8_LINEAR(int8_linear_bf16, uint16_t, bf16_load, bf16_store, quantize_rows_bf16)
