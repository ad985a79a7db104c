/* The packed layouts of paged_prefill_bf16.c's pair products, and the products on 512-bit vectors
 * (AVX512-BF16's VDPBF16PS) where there are no AMX tiles: keys as 32-bit words (a key's pair of dims)
 * 16 keys side by side, [GROUPS][CHUNKS][16 x 16] (a B tile each), values as words of two keys' values
 * of one dim, [PAIRS][dims / 16][16 x 16]. The tiles' own products stay in paged_prefill_bf16.c.
 */
#ifndef PAIR_VECTORS_H
#define PAIR_VECTORS_H

#include "paged_common.h"
#include "prefill_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAIR_PRODUCTS 1
#include <immintrin.h>

#define GROUPS (KC / 16)          /* B tiles of 16 keys per step (scores) */
#define PAIRS (KC / 32)           /* A and B tiles of 32 keys per step (weighted values) */
#define CHUNKS (MAX_HEAD_DIM / 32) /* 32 dims per A tile row */

/* dst[p * 16 + j] = the 32-bit word p (bfloat16 values 2p, 2p + 1 from `from`) of row j, for 16 rows
 * of 16 words: a 16 x 16 transpose of words in registers (pairs, quads, then 128-bit lanes). */
static inline void transpose_words(const uint16_t *const *row, int64_t from, uint32_t *dst) {
    __m512i r[16], t[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(row[j] + from);
    for (int j = 0; j < 16; j += 2) { /* lane L: rows j, j + 1 of words 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi) */
        t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) { /* r[j + k], lane L: word 4L + k of rows j..j + 3 */
        r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
        r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
        r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
        r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int k = 0; k < 4; k++) { /* word 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k] */
        const __m512i x0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xee);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xee);
        _mm512_storeu_si512(dst + (0 + k) * 16, _mm512_shuffle_i32x4(x0, y0, 0x88));
        _mm512_storeu_si512(dst + (4 + k) * 16, _mm512_shuffle_i32x4(x0, y0, 0xdd));
        _mm512_storeu_si512(dst + (8 + k) * 16, _mm512_shuffle_i32x4(x1, y1, 0x88));
        _mm512_storeu_si512(dst + (12 + k) * 16, _mm512_shuffle_i32x4(x1, y1, 0xdd));
    }
}

/* 16 words: even[d] in the low half, odd[d] in the high half (a pair of keys' values of dim d). */
static inline __m512i interleave16(const uint16_t *even, const uint16_t *odd) {
    const __m512i e = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)even));
    const __m512i o = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)odd));
    return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

/* A pair of bfloat16 values (at p, p + 1) as one 32-bit word in every lane. */
static inline __m512bh pair16(const uint16_t *p) {
    uint32_t word;
    memcpy(&word, p, sizeof word);
    return (__m512bh)_mm512_set1_epi32((int)word);
}

/* The same as tile_scores on vectors: four rows and the step's four key groups at a time (16 sums in
 * registers), a row's pair of dims broadcast against 16 keys' pairs; rows up to `rows4`, a multiple of 4
 * (the rows past the task's are zero queries). */
static void vector_scores(const uint16_t *qb, uint32_t kt[GROUPS][CHUNKS][16 * 16], float *sc, int64_t rows4,
                          int64_t head_dim) {
    for (int64_t x = 0; x < rows4; x += 4) {
        __m512 a[4][GROUPS];
        for (int r = 0; r < 4; r++)
            for (int g = 0; g < GROUPS; g++) a[r][g] = _mm512_setzero_ps();
        for (int64_t w = 0; w < head_dim / 2; w++) {
            __m512bh k[GROUPS];
            for (int g = 0; g < GROUPS; g++) k[g] = (__m512bh)_mm512_loadu_si512(&kt[g][w / 16][(w % 16) * 16]);
            for (int r = 0; r < 4; r++) {
                const __m512bh qw = pair16(qb + (x + r) * head_dim + 2 * w);
                for (int g = 0; g < GROUPS; g++) a[r][g] = _mm512_dpbf16_ps(a[r][g], qw, k[g]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int g = 0; g < GROUPS; g++) _mm512_storeu_ps(sc + (x + r) * KC + g * 16, a[r][g]);
    }
}

/* The same as tile_values on vectors: four rows and `width` blocks of 16 dims (from block b0) at a time,
 * a row's pair of weights (each part) broadcast against 16 dims' pairs of values; `pairs` key pairs. */
static inline void vector_values_block(const uint16_t *pb, const uint16_t *pr,
                                       uint32_t vp[PAIRS][MAX_HEAD_DIM / 16][16 * 16], float *acc, int64_t x,
                                       int64_t b0, int width, int64_t pairs, int64_t head_dim) {
    __m512 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < width; j++) a[r][j] = _mm512_loadu_ps(acc + (x + r) * head_dim + (b0 + j) * 16);
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh hi[4], lo[4];
        for (int r = 0; r < 4; r++) {
            hi[r] = pair16(pb + (x + r) * KC + 2 * p);
            lo[r] = pair16(pr + (x + r) * KC + 2 * p);
        }
        for (int j = 0; j < width; j++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(&vp[p / 16][b0 + j][(p % 16) * 16]);
            for (int r = 0; r < 4; r++) a[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[r][j], hi[r], v), lo[r], v);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < width; j++) _mm512_storeu_ps(acc + (x + r) * head_dim + (b0 + j) * 16, a[r][j]);
}

static void vector_values(const uint16_t *pb, const uint16_t *pr, uint32_t vp[PAIRS][MAX_HEAD_DIM / 16][16 * 16],
                          float *acc, int64_t rows4, int64_t padded, int64_t head_dim) {
    for (int64_t x = 0; x < rows4; x += 4) {
        int64_t b = 0;
        for (; b + 4 <= head_dim / 16; b += 4) vector_values_block(pb, pr, vp, acc, x, b, 4, padded / 2, head_dim);
        if (b < head_dim / 16) vector_values_block(pb, pr, vp, acc, x, b, 2, padded / 2, head_dim); /* 32 dims */
    }
}
#endif

#endif
