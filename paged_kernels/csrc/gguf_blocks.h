/* What the GGUF kernels share about the file's blocks (csrc/gguf_linear.c: int16 inputs; csrc/gguf_x8.c:
 * int8 inputs): ggml's type ids, the super-block's shape, the half-precision factors, Q4_K's packed
 * scales. */
#ifndef GGUF_BLOCKS_H
#define GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q6_K = 14 }; /* ggml's ids, as the file stores them */
#define SUPER 256                                       /* inputs per int16 scale of x, and per K-quant block */
#define SUBS (SUPER / 32)                               /* sub-blocks of 32 per super-block */
#define PREFETCH 2048  /* bytes of weights ahead of the block decoded, asked of memory (1.5B, one row:
                          108 -> 65 ms for all matrices; 1,024 and 4,096 slower) */

/* The bytes one super-block's worth (256 weights) takes; 0: a type the kernels do not run. */
int64_t gguf_super_bytes(int type);

static inline float half_load(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: value mant * 2^-24 */
        float f = (float)mant * 5.9604644775390625e-08f;
        return (h & 0x8000) ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX2__)
/* Q4_K's scales and minimums as 16 int16 (lanes 0-7: scales, 8-15: minimums), from their twelve
 * bytes (words u0 u1 u2) in vector registers: scales 0-3 = u0 & 0x3F.., 4-7 = (u2 & 0x0F..) | the top
 * two bits of u0's bytes at bits 4-5; minimums 0-3 = u1 & 0x3F.., 4-7 = (u2 >> 4 & 0x0F..) | u1's top
 * bits. Reads four bytes past the twelve (the block's first quants). */
static inline __m256i q4k_scales16(const uint8_t *s) {
    const __m128i u = _mm_loadu_si128((const __m128i *)s);
    const __m128i a = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)); /* u0 u2 u1 u2 */
    const __m128i b = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)); /* u0 u0 u1 u1 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
    const __m128i top = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm256_cvtepu8_epi16(_mm_or_si128(low, top));
}
#endif

#endif
