/* bfloat16 on 512-bit vectors, for the kernels that use AVX-512 (with or without AMX tiles):
 * float_linear.c's AMX outputs and paged_prefill_bf16.c's softmax and products.
 */
#ifndef BF16_VECTORS_H
#define BF16_VECTORS_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 values widened to float32 (exact). */
static inline __m512 bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

#endif
