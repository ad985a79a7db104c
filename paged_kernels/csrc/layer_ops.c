/* The small operations of a decoder layer around its matrix calls, one C call each instead of
 * a dozen torch operations (paged_kernels/native_layer_ops.py): RMSNorm, rotary embedding of q and k
 * with the store of k and v into their cache slots, and SiLU(gate) * up.
 *
 * Each rounds where torch rounds: at a bfloat16 model every torch operation rounds its result to
 * bfloat16, and so does the same step here (`ROUND`), so the results are torch's bit for bit but
 * for the order of the norm's sum and the e^x of SiLU. No multiply and add are fused into one
 * (torch rounds the product first): this file is compiled without contraction (the pragma below).
 */
#pragma GCC optimize("fp-contract=off")

#include <stdint.h>

#include "paged_common.h"

static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) {
    uint16_t h;
    bf16_store(&h, x);
    return bf16_load(&h);
}

/* out = weight * (x / sqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm: the normalised row is
 * rounded to the model's dtype before the weight multiplies it. Rows in parallel when there are many. */
#define RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                         \
    void NAME(const T *x, const T *weight, T *out, int64_t rows, int64_t dim, int64_t x_stride, float eps, \
              int threads) {                                                                         \
        _Pragma("omp parallel for num_threads(threads) if(rows > 8)")                                \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            const T *row = x + r * x_stride;                                                         \
            double sum = 0.0;                                                                        \
            for (int64_t d = 0; d < dim; d++) {                                                      \
                const float v = LOAD(row + d);                                                       \
                sum += (double)(v * v);                                                              \
            }                                                                                        \
            const float inv = 1.0f / sqrtf((float)(sum / (double)dim) + eps);                        \
            T *dst = out + r * dim;                                                                  \
            for (int64_t d = 0; d < dim; d++) STORE(dst + d, LOAD(weight + d) * ROUND(LOAD(row + d) * inv)); \
        }                                                                                            \
    }

/* Rotate one head in place: x * cos + rotate_half(x) * sin, each product and the sum rounded. */
#define ROTATE(T, LOAD, STORE, ROUND)                                                                 \
    static inline void rotate_##T(T *x, const T *cos, const T *sin, int64_t dim) {                   \
        const int64_t half = dim / 2;                                                                \
        float rotated[MAX_HEAD_DIM];                                                                 \
        for (int64_t d = 0; d < dim; d++) {                                                          \
            const float other = d < half ? -LOAD(x + d + half) : LOAD(x + d - half);                \
            rotated[d] = ROUND(ROUND(LOAD(x + d) * LOAD(cos + d)) + ROUND(other * LOAD(sin + d)));    \
        }                                                                                            \
        for (int64_t d = 0; d < dim; d++) STORE(x + d, rotated[d]);                                  \
    }
ROTATE(float, f32_load, f32_store, f32_round)
ROTATE(uint16_t, bf16_load, bf16_store, bf16_round)

/* q [tokens, heads, dim] and k, v [tokens, kv_heads, dim] (rows `stride` elements apart: views of one
 * q/k/v projection), cos and sin [tokens, dim]: q and k rotated in place, then k and v copied into the
 * caches' rows [slots, kv_heads, dim] (slot < 0: not stored). */
#define ROPE_STORE(NAME, T, LOAD, STORE, ROUND)                                                       \
    void NAME(T *q, T *k, const T *v, int64_t stride, const T *cos, const T *sin, T *k_cache,         \
              T *v_cache, const int64_t *slots, int64_t tokens, int64_t heads, int64_t kv_heads,       \
              int64_t dim, int threads) {                                                            \
        _Pragma("omp parallel for num_threads(threads) if(tokens > 8)")                              \
        for (int64_t t = 0; t < tokens; t++) {                                                       \
            const T *c = cos + t * dim, *s = sin + t * dim;                                          \
            for (int64_t h = 0; h < heads; h++) rotate_##T(q + t * stride + h * dim, c, s, dim);     \
            for (int64_t h = 0; h < kv_heads; h++) rotate_##T(k + t * stride + h * dim, c, s, dim);  \
            if (slots[t] < 0) continue;                                                              \
            const int64_t row = kv_heads * dim;                                                      \
            memcpy(k_cache + slots[t] * row, k + t * stride, (size_t)row * sizeof(T));              \
            memcpy(v_cache + slots[t] * row, v + t * stride, (size_t)row * sizeof(T));              \
        }                                                                                            \
    }

/* out [rows, inter] = silu(gate) * up, from gate_up [rows, 2 * inter]: silu rounded, then the product.
 * A row in chunks of SILU_CHUNK: the silus into a float buffer, then rounded and multiplied, two loops
 * the compiler vectorises (in one, bf16_store's NaN branch kept the whole loop scalar: 64 rows of
 * 8,960 took 3.2 ms, 28 layers 88 ms a decode step). The same arithmetic per value either way. */
#define SILU_CHUNK 512
#define SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                         \
    void NAME(const T *gate_up, T *out, int64_t rows, int64_t inter, int threads) {                 \
        _Pragma("omp parallel for num_threads(threads) if(rows > 8)")                                \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            const T *gate = gate_up + r * 2 * inter, *up = gate + inter;                             \
            T *dst = out + r * inter;                                                                \
            float silu[SILU_CHUNK];                                                                  \
            for (int64_t first = 0; first < inter; first += SILU_CHUNK) {                            \
                const int64_t n = inter - first < SILU_CHUNK ? inter - first : SILU_CHUNK;           \
                for (int64_t i = 0; i < n; i++) {                                                    \
                    const float g = LOAD(gate + first + i);                                          \
                    silu[i] = g / (1.0f + fast_expf(-g));                                            \
                }                                                                                    \
                for (int64_t i = 0; i < n; i++) STORE(dst + first + i, ROUND(silu[i]) * LOAD(up + first + i)); \
            }                                                                                        \
        }                                                                                            \
    }

RMS_NORM(rms_norm_f32, float, f32_load, f32_store, f32_round)
RMS_NORM(rms_norm_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
ROPE_STORE(rope_store_f32, float, f32_load, f32_store, f32_round)
ROPE_STORE(rope_store_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
SILU_MUL(silu_mul_f32, float, f32_load, f32_store, f32_round)
SILU_MUL(silu_mul_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
