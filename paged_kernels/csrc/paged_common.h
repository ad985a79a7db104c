/* What the paged-attention kernels share: bfloat16 loads and stores, a vectorisable e^x, and the
 * loaders that turn one cache row (a position's head_dim values of one KV head, at the model's dtype
 * or quantized: paged_kernels/kv_format.py) into float32. Included by paged_attention.c (one query token
 * per task) and paged_prefill.c (a tile of a prefill chunk's tokens per task).
 */
#ifndef PAGED_COMMON_H
#define PAGED_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK_SIZE 256

static inline float bf16_load(const uint16_t *x) {
    uint32_t bits = (uint32_t)(*x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void bf16_store(uint16_t *x, float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays NaN */
        *x = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    *x = (uint16_t)(bits >> 16);
}

/* e^x to about two ulp, in plain arithmetic the compiler vectorises (libm's expf is a scalar call
 * per score). Cephes' range reduction and polynomial; x is clamped to [-87, 88], so -inf (the
 * running maximum before the first block) gives ~1e-38 times an accumulator that is still zero. */
#define EXP_LOW (-87.0f) /* the clamp, the reduction and the polynomial: paged_prefill_bf16.c's exp16 too */
#define EXP_HIGH 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 in two parts: n * ln 2 subtracted exactly */
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
static inline float fast_expf(float x) {
    x = x < EXP_LOW ? EXP_LOW : (x > EXP_HIGH ? EXP_HIGH : x);
    const float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = x - n * EXP_LN2_HI;
    r = r + n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float f32_load(const float *x) { return *x; }
static inline void f32_store(float *x, float f) { *x = f; }

/* The bfloat16 scale at the end of a quantized row (unaligned: read through memcpy). */
static inline float scale_load(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return bf16_load(&h);
}

/* One cache row (a position's head_dim values of one KV head) into float32. */
static inline void f32_row(float *dst, const float *src, int64_t n, const float *lut) {
    (void)lut;
    for (int64_t d = 0; d < n; d++) dst[d] = src[d];
}
static inline void bf16_row(float *dst, const uint16_t *src, int64_t n, const float *lut) {
    (void)lut;
    for (int64_t d = 0; d < n; d++) dst[d] = bf16_load(src + d);
}
/* Quantized rows: codes then the scale. A table lookup per code does not vectorise, so int8 codes
 * are converted arithmetically (the compiler widens 16 per instruction); the fp8 formats go through
 * the table (an arithmetic e4m3 decoding measured slower than it). */
static inline void byte_row(float *dst, const uint8_t *src, int64_t n, const float *lut) {
    const float s = scale_load(src + n);
    for (int64_t d = 0; d < n; d++) dst[d] = lut[src[d]] * s;
}
static inline void int8_row(float *dst, const uint8_t *src, int64_t n, const float *lut) {
    (void)lut;
    const float s = scale_load(src + n);
    const int8_t *codes = (const int8_t *)src;
    _Pragma("omp simd")
    for (int64_t d = 0; d < n; d++) dst[d] = (float)codes[d] * s;
}

/* Calls TASK ARGS with head_dim (the caller's variable of that name, which ARGS passes) as a
 * constant where it is one of the common head sizes, so the task inlined there has loops of known
 * length; with the caller's value otherwise. */
#define SPECIALISED(TASK, ARGS)                                                   \
    do {                                                                          \
        if (head_dim == 64) {                                                     \
            const int64_t head_dim = 64;                                          \
            TASK ARGS;                                                            \
        } else if (head_dim == 128) {                                             \
            const int64_t head_dim = 128;                                         \
            TASK ARGS;                                                            \
        } else {                                                                  \
            TASK ARGS;                                                            \
        }                                                                         \
    } while (0)

/* Every layout a kernel is built for, as X(name, T, LOAD, STORE, C, EXTRA, ROW): T the type of q and
 * out, C the cache's element type, EXTRA the elements a row holds past its head_dim values (a
 * quantized row's scale), ROW the loader of one row; the name gets the layout's suffix
 * (paged_kernels/native_attention.py looks them up by it). */
#define FOR_EACH_LAYOUT(X, NAME)                                                \
    X(NAME##_f32, float, f32_load, f32_store, float, 0, f32_row)                \
    X(NAME##_bf16, uint16_t, bf16_load, bf16_store, uint16_t, 0, bf16_row)      \
    X(NAME##_f32_q8, float, f32_load, f32_store, uint8_t, 2, byte_row)          \
    X(NAME##_bf16_q8, uint16_t, bf16_load, bf16_store, uint8_t, 2, byte_row)    \
    X(NAME##_f32_i8, float, f32_load, f32_store, uint8_t, 2, int8_row)          \
    X(NAME##_bf16_i8, uint16_t, bf16_load, bf16_store, uint8_t, 2, int8_row)

#endif
