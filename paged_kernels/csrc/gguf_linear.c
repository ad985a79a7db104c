/* A linear layer whose weight is a GGUF file's quantized blocks, executed as stored
 * (paged_kernels/native_gguf_ops.py, worker/runner/cpu/gguf_linear.py): out[m, n] = sum_k w[n, k] * x[m, k]
 * (+ bias[n]), w[n, :] one row of the file's blocks (Q4_K, Q6_K or Q8_0; ggml's type ids), untouched.
 *
 * Each row of x is taken to int16 per super-block of 256 inputs (absmax / 32767, as csrc/int8_linear.c
 * does: every value within 1/65534 of its group's largest), so a block's sum of products is integer
 * arithmetic: a super-block's weights are decoded to int16 with their sub-block scales folded in
 * (Q4_K: scale * q, at most 63 * 15; Q6_K: scale * (q - 32), at most 128 * 32), multiplied pairwise
 * with the input and summed in int32 lanes (exact: a lane's 16 products stay under 2^31), then
 * scaled once per super-block in float (Q8_0: once per block of 32). Q4_K's minimums are a
 * sub-block's input sum times dmin * min, from sums of each row's inputs taken once per row.
 * So a row's result depends on that row alone: the same for a row alone or in a batch.
 *
 * Rows of x are taken a tile at a time against each output row, whose blocks stay in the L1 cache
 * across tiles: the weights are read from memory once per call, decoded once per tile. With AVX-512
 * (BW, VNNI) a decoded super-block is eight registers of 32 int16 and vpdpwssd multiplies them with
 * the input. With AVX2 (and FMA), up to 4 rows take the K-quants' codes as bytes, undecoded: vpmaddubsw
 * multiplies them by each input code's high (signed) and low (unsigned) byte apart (256 * high + low
 * being the code) and vpmaddwd by the scales, the int16 path's exact integers at about half the
 * instructions; more rows multiply a super-block decoded once into the L1 cache (vpmaddwd), the same
 * integers in the same lanes, so the same bits (row_dot_of's AVX2 form). Elsewhere plain C. An int32
 * lane adds at most 16 products (Q6_K's largest, 128 * 32 * 32,767, times 16 is under 2^31), or 8 of
 * the byte path's codes 0..63 (128 * 63 * 32,768 each), then goes to float.
 *
 * On a CPU with AMX, a bfloat16 batch of GGUF_AMX_ROWS rows or more goes to csrc/gguf_amx.c instead:
 * the weights decoded to bf16 (as a batch's GEMM decodes them) and multiplied on tiles, so a row's
 * bits there depend on whether its batch reached that size (as they do at the GEMM size).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "gguf_blocks.h"
#include "paged_common.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GGUF_VNNI512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define GGUF_AVX2 1
#include <immintrin.h>
#endif

#define TILE 4         /* rows of x whose sums stay in registers (8 spills: slower) */
#define MANY 16        /* rows of x against one decoded super-block, their sums in the L1 cache */

/* gguf_blocks.h */
int64_t gguf_super_bytes(int type) {
    switch (type) {
    case TYPE_Q4_K: return 144;
    case TYPE_Q6_K: return 210;
    case TYPE_Q8_0: return 8 * 34;
    default: return 0;
    }
}

/* Q4_K's twelve bytes of 6-bit scales and minimums, sub-blocks 0..7. */
static inline void q4k_scales(const uint8_t *s, uint8_t sc[SUBS], uint8_t mn[SUBS]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* One super-block decoded to int16 with its sub-block scales folded in (w[256], in input order),
 * the float factor of each sub-block of 32 (fac[8]) and what each sub-block's input sum is multiplied
 * by and taken off (mins[8]: Q4_K's dmin * min, else 0). */
static __attribute__((unused)) void decode_plain(int type, const uint8_t *blk, int16_t *w, float *fac, float *mins) {
    if (type == TYPE_Q4_K) {
        const float d = half_load(blk), dmin = half_load(blk + 2);
        uint8_t sc[SUBS], mn[SUBS];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t *qs = blk + 16;
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                w[64 * j + l] = (int16_t)(sc[2 * j] * (qs[32 * j + l] & 0xF));
                w[64 * j + 32 + l] = (int16_t)(sc[2 * j + 1] * (qs[32 * j + l] >> 4));
            }
        for (int j = 0; j < SUBS; j++) {
            fac[j] = d;
            mins[j] = dmin * mn[j];
        }
    } else if (type == TYPE_Q6_K) {
        const float d = half_load(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const int8_t *s = sc + 8 * h;
            int16_t *o = w + 128 * h;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                o[l] = (int16_t)(s[is] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32));
                o[l + 32] = (int16_t)(s[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32));
                o[l + 64] = (int16_t)(s[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32));
                o[l + 96] = (int16_t)(s[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32));
            }
        }
        for (int j = 0; j < SUBS; j++) {
            fac[j] = d;
            mins[j] = 0.0f;
        }
    } else { /* Q8_0: eight blocks of a half scale and 32 int8 */
        for (int j = 0; j < SUBS; j++) {
            const uint8_t *b = blk + 34 * j;
            fac[j] = half_load(b);
            mins[j] = 0.0f;
            for (int l = 0; l < 32; l++) w[32 * j + l] = (int8_t)b[2 + l];
        }
    }
}

/* A row of x in int16 per super-block: xq[in], xs[supers] scales, xsum[supers * SUBS] each sub-block's
 * sum of inputs times its scale (float; Q4_K's minimums multiply it). */
#define QUANTIZE_ROW(NAME, T, LOAD)                                                                     \
    static void NAME(const T *x, int16_t *xq, float *xs, float *xsum, int64_t in) {                    \
        for (int64_t b = 0; b < in / SUPER; b++) {                                                    \
            float top = 0.0f;                                                                         \
            for (int k = 0; k < SUPER; k++) top = fmaxf(top, fabsf(LOAD(x + b * SUPER + k)));         \
            const float scale = top > 0.0f ? top / 32767.0f : 1.0f, inv = 1.0f / scale;               \
            xs[b] = scale;                                                                            \
            for (int j = 0; j < SUBS; j++) {                                                          \
                int32_t sum = 0;                                                                      \
                for (int l = 0; l < 32; l++) {                                                        \
                    const int64_t k = b * SUPER + j * 32 + l;                                         \
                    const float v = nearbyintf(LOAD(x + k) * inv);                                   \
                    xq[k] = (int16_t)(v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v));     \
                    sum += xq[k];                                                                     \
                }                                                                                     \
                xsum[b * SUBS + j] = (float)sum * scale;                                              \
            }                                                                                         \
        }                                                                                             \
    }

QUANTIZE_ROW(quantize_row_f32, float, f32_load)
QUANTIZE_ROW(quantize_row_bf16, uint16_t, bf16_load)

#if GGUF_AVX2
#define PLANES 1
#else
#define PLANES 0
#endif

/* A row's int16 codes as byte planes (AVX2's K-quant paths): per 32 inputs, their 32 high bytes
 * (signed), then their 32 low bytes (unsigned), each code being 256 * high + low; and x16[in / 16], each
 * 16 codes' sum (Q6_K's offset of 32). */
static void split_planes(const int16_t *xq, int8_t *xp, int32_t *x16, int64_t in) {
    for (int64_t c = 0; c < in; c += 32)
        for (int l = 0; l < 32; l++) {
            xp[2 * c + l] = (int8_t)(xq[c + l] >> 8);
            xp[2 * c + 32 + l] = (int8_t)(uint8_t)(xq[c + l] & 0xFF);
        }
    for (int64_t g = 0; g < in / 16; g++) {
        int32_t sum = 0;
        for (int l = 0; l < 16; l++) sum += xq[16 * g + l];
        x16[g] = sum;
    }
}

#if GGUF_VNNI512
static inline __m512i dpwssd16(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); /* in place (see csrc/int8_linear.c) */
    return acc;
}

static inline __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }

/* Lane `j` of 16 int16 (a ymm) in all 32 lanes of a zmm; `pick[k]`: the index vector of lane k. */
static inline __m512i lane16(__m256i v, __m512i pick) {
    return _mm512_permutexvar_epi16(pick, _mm512_castsi256_si512(v));
}

/* decode_plain's int16 weights in eight registers; fac[0] the super-block's factor (K-quants). `picks`:
 * index vectors (K-quants' scale lanes). */
static inline __attribute__((always_inline)) void decode_vnni(const int type, const uint8_t *blk, __m512i w[SUBS], float *fac, float *mins,
                               const __m512i *picks) {
    if (type == TYPE_Q4_K) {
        const __m256i sm = q4k_scales16(blk + 4);
        const __m512i low = _mm512_set1_epi16(0xF);
        for (int j = 0; j < 4; j++) {
            const __m512i v = bytes16(blk + 16 + 32 * j);
            w[2 * j] = _mm512_mullo_epi16(_mm512_and_si512(v, low), lane16(sm, picks[2 * j]));
            w[2 * j + 1] = _mm512_mullo_epi16(_mm512_srli_epi16(v, 4), lane16(sm, picks[2 * j + 1]));
        }
        fac[0] = half_load(blk);
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(sm, 1)));
        _mm256_storeu_ps(mins, _mm256_mul_ps(mn, _mm256_set1_ps(half_load(blk + 2))));
    } else if (type == TYPE_Q6_K) {
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i m4 = _mm512_set1_epi16(0xF), m3 = _mm512_set1_epi16(3), mc = _mm512_set1_epi16(0xC);
        const __m512i m30 = _mm512_set1_epi16(0x30), bias = _mm512_set1_epi16(32);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const __m512i a = bytes16(ql), b = bytes16(ql + 32), hi = bytes16(qh);
            const __m512i v0 = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi16(_mm512_and_si512(hi, m3), 4));
            const __m512i v1 = _mm512_or_si512(_mm512_and_si512(b, m4), _mm512_slli_epi16(_mm512_and_si512(hi, mc), 2));
            const __m512i v2 = _mm512_or_si512(_mm512_srli_epi16(a, 4), _mm512_and_si512(hi, m30));
            const __m512i v3 = _mm512_or_si512(_mm512_srli_epi16(b, 4), _mm512_and_si512(_mm512_srli_epi16(hi, 2), m30));
            w[4 * h] = _mm512_mullo_epi16(_mm512_sub_epi16(v0, bias), lane16(sc, picks[SUBS + 4 * h]));
            w[4 * h + 1] = _mm512_mullo_epi16(_mm512_sub_epi16(v1, bias), lane16(sc, picks[SUBS + 4 * h + 1]));
            w[4 * h + 2] = _mm512_mullo_epi16(_mm512_sub_epi16(v2, bias), lane16(sc, picks[SUBS + 4 * h + 2]));
            w[4 * h + 3] = _mm512_mullo_epi16(_mm512_sub_epi16(v3, bias), lane16(sc, picks[SUBS + 4 * h + 3]));
        }
        fac[0] = half_load(blk + 208);
    } else {
        for (int j = 0; j < SUBS; j++) {
            fac[j] = half_load(blk + 34 * j);
            w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 34 * j + 2)));
        }
    }
}

/* The index vectors decode_vnni takes: [0, 8) Q4_K's scale j in every lane; [8, 16) Q6_K's register
 * k of a half: scale 2k (of that half's eight) in lanes 0-15, 2k + 1 in lanes 16-31. */
static void scale_picks(__m512i picks[2 * SUBS]) {
    for (int j = 0; j < SUBS; j++) picks[j] = _mm512_set1_epi16((short)j);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            picks[SUBS + 4 * h + k] = _mm512_mask_set1_epi16(_mm512_set1_epi16((short)(8 * h + 2 * k)), 0xFFFF0000u,
                                                             (short)(8 * h + 2 * k + 1));
}

/* One output row against `rows` (<= `most`) rows of x: out[r] for r < rows (inlined per type and
 * `most`, both constants: TILE rows' sums stay in registers, MANY rows' in the L1 cache, each
 * super-block decoded once for all of them). */
static inline __attribute__((always_inline)) void row_dot_of(const int type, const int most, const uint8_t *wrow,
                                                             int64_t supers, const int16_t *xq, const int8_t *xp,
                                                             const int32_t *x16, const float *xs, const float *xsum,
                                                             int64_t in, int rows, float *out) {
    (void)xp, (void)x16;
    __m512 f[most];
    __m256 fm[most];
    for (int r = 0; r < most; r++) {
        f[r] = _mm512_setzero_ps();
        fm[r] = _mm256_setzero_ps();
    }
    const int64_t bytes = gguf_super_bytes(type);
    __m512i picks[2 * SUBS];
    scale_picks(picks);
    for (int64_t b = 0; b < supers; b++) {
        __m512i w[SUBS];
        float fac[SUBS] = {0}, mins[SUBS] = {0}; /* each type sets what it reads */
        const uint8_t *ahead = wrow + b * bytes + PREFETCH; /* the stream of blocks, asked of memory early */
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        decode_vnni(type, wrow + b * bytes, w, fac, mins, picks);
        const __m256 mv = _mm256_loadu_ps(mins);
        for (int r = 0; r < rows; r++) {
            const int16_t *x = xq + r * in + b * SUPER;
            if (type == TYPE_Q8_0) {
                for (int j = 0; j < SUBS; j++) {
                    const __m512i acc = _mm512_madd_epi16(w[j], _mm512_loadu_si512(x + 32 * j));
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(fac[j] * xs[r * (in / SUPER) + b]), f[r]);
                }
                continue;
            }
            __m512i acc = _mm512_madd_epi16(w[0], _mm512_loadu_si512(x)), acc1 = _mm512_madd_epi16(w[1], _mm512_loadu_si512(x + 32));
            for (int j = 2; j < SUBS; j += 2) { /* two chains in flight */
                acc = dpwssd16(acc, w[j], _mm512_loadu_si512(x + 32 * j));
                acc1 = dpwssd16(acc1, w[j + 1], _mm512_loadu_si512(x + 32 * j + 32));
            }
            acc = _mm512_add_epi32(acc, acc1);
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(fac[0] * xs[r * (in / SUPER) + b]), f[r]);
            if (type == TYPE_Q4_K) fm[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * (in / 32) + b * SUBS), fm[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m128 m = _mm_add_ps(_mm256_castps256_ps128(fm[r]), _mm256_extractf128_ps(fm[r], 1));
        m = _mm_hadd_ps(m, m);
        m = _mm_hadd_ps(m, m);
        out[r] = _mm512_reduce_add_ps(f[r]) - _mm_cvtss_f32(m);
    }
}

#elif GGUF_AVX2
/* Q6_K's 6-bit codes (0..63) of half `h`, as bytes: q[k] holds values 128h + 32k + l, l < 32, from the
 * half's 64 bytes of low 4 bits and 32 of high 2 bits. */
static inline __attribute__((always_inline)) void q6k_codes(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i nibble = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3), mc = _mm256_set1_epi8(0xC);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 64 * h)), b = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_slli_epi16(_mm256_and_si256(hb, mc), 2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), nibble), _mm256_and_si256(hb, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
}

static inline __m256i mul16(__m256i v, int16_t scale) { return _mm256_mullo_epi16(v, _mm256_set1_epi16(scale)); }

/* decode_plain's result (the same int16 weights, factors and minimums) with 256-bit vectors. */
static inline __attribute__((always_inline)) void decode_avx2(const int type, const uint8_t *blk, int16_t *w, float *fac,
                                                              float *mins) {
    if (type == TYPE_Q4_K) {
        const __m256i sm = q4k_scales16(blk + 4);
        int16_t sc[16];
        _mm256_storeu_si256((__m256i *)sc, sm);
        const __m256i low = _mm256_set1_epi8(0xF);
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            __m256i *o = (__m256i *)(w + 64 * j);
            _mm256_storeu_si256(o, mul16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), sc[2 * j]));
            _mm256_storeu_si256(o + 1, mul16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)), sc[2 * j]));
            _mm256_storeu_si256(o + 2, mul16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), sc[2 * j + 1]));
            _mm256_storeu_si256(o + 3, mul16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)), sc[2 * j + 1]));
        }
        const float d = half_load(blk);
        for (int j = 0; j < SUBS; j++) fac[j] = d;
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(sm, 1)));
        _mm256_storeu_ps(mins, _mm256_mul_ps(mn, _mm256_set1_ps(half_load(blk + 2))));
    } else if (type == TYPE_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192); /* one scale per 16 values */
        const __m256i bias = _mm256_set1_epi16(32);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_codes(blk, h, q);
            for (int k = 0; k < 4; k++) {
                __m256i *o = (__m256i *)(w + 128 * h + 32 * k);
                const __m256i lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q[k]));
                const __m256i hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q[k], 1));
                _mm256_storeu_si256(o, mul16(_mm256_sub_epi16(lo, bias), sc[8 * h + 2 * k]));
                _mm256_storeu_si256(o + 1, mul16(_mm256_sub_epi16(hi, bias), sc[8 * h + 2 * k + 1]));
            }
        }
        const float d = half_load(blk + 208);
        for (int j = 0; j < SUBS; j++) {
            fac[j] = d;
            mins[j] = 0.0f;
        }
    } else {
        for (int j = 0; j < SUBS; j++) {
            const uint8_t *b = blk + 34 * j;
            fac[j] = half_load(b);
            mins[j] = 0.0f;
            _mm256_storeu_si256((__m256i *)(w + 32 * j), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2))));
            _mm256_storeu_si256((__m256i *)(w + 32 * j + 16), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18))));
        }
    }
}

static inline float sum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_hadd_ps(m, m);
    m = _mm_hadd_ps(m, m);
    return _mm_cvtss_f32(m);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* A vpshufb mask that fills the low 128-bit lane with its int16 `lo`, the high lane with its `hi`. */
static inline __m256i word_pick(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(2 * hi | (2 * hi + 1) << 8)), _mm_set1_epi16((short)(2 * lo | (2 * lo + 1) << 8)));
}

/* Both AVX2 ways to a K-quant super-block's products (q4k_planes and q6k_planes on the input's byte
 * planes; kquant_decoded on int16 decoded weights) put the same exact integers in the same int32 lanes,
 * lane i holding values 4i..4i+3 of each 32, and take them to float in the same order: a row's result
 * has the same bits whichever way, alone or in a batch. */

/* One Q4_K super-block against `rows` (<= TILE) rows' input planes (split_planes: per 32 inputs, 32 high
 * bytes then 32 low bytes): vpmaddubsw multiplies 32 codes (0..15) by 32 high bytes (at most 2 x 15 x
 * 128 a pair) and 32 low bytes by the codes (at most 2 x 255 x 15), vpmaddwd those by 256 x scale and by
 * scale; a lane adds 32 of scale x code x input (at most 945 x 32,767 each). */
static inline __attribute__((always_inline)) void q4k_planes(const uint8_t *blk, const int8_t *xp, int64_t in, int rows,
                                                             __m256i *acc) {
    const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(q4k_scales16(blk + 4))); /* scales 0-7, each lane */
    const __m256i sc256 = _mm256_slli_epi16(sc, 8), nibble = _mm256_set1_epi8(0xF);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i v = load32(blk + 16 + 32 * j);
        const __m256i codes[2] = {_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
        for (int half = 0; half < 2; half++) { /* sub-block 2j + half */
            const __m256i high = _mm256_shuffle_epi8(sc256, word_pick(2 * j + half, 2 * j + half));
            const __m256i low = _mm256_shuffle_epi8(sc, word_pick(2 * j + half, 2 * j + half));
            for (int r = 0; r < rows; r++) {
                const int8_t *p = xp + 2 * (r * in + 64 * j + 32 * half);
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(codes[half], load32(p)), high));
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(load32(p + 32), codes[half]), low));
            }
        }
    }
}

/* Q6_K's codes' offset of 32, in g's units: 32 times each 16 inputs' sum (x16) times its scale, a lane
 * at most 2 x 128 x 16 x 32,767; taken off g. */
static inline __attribute__((always_inline)) void q6k_offset(const uint8_t *blk, const int32_t *x16, int64_t in, int rows,
                                                             __m256 *g) {
    const __m256i s_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192)));
    const __m256i s_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 200)));
    for (int r = 0; r < rows; r++) {
        const int32_t *sums = x16 + r * (in / 16);
        const __m256i offset = _mm256_add_epi32(_mm256_mullo_epi32(s_lo, load32(sums)), _mm256_mullo_epi32(s_hi, load32(sums + 8)));
        g[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(-32.0f), g[r]);
    }
}

/* One Q6_K super-block against `rows` (<= TILE) rows' input planes, into g: the codes taken as 0..63,
 * vpmaddubsw by the high bytes (at most 2 x 63 x 128 a pair) and the low bytes by the codes (at most
 * 2 x 255 x 63: never saturated), vpmaddwd by 256 x scale and by scale (an int8: 256 x -128 is still an
 * int16); each 64 values' lanes (8 products of at most 128 x 63 x 32,768: under 2^31, as a test holds)
 * to float; then the offset (q6k_offset). */
static inline __attribute__((always_inline)) void q6k_planes(const uint8_t *blk, const int8_t *xp, const int32_t *x16,
                                                             int64_t in, int rows, __m256 *g) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    for (int r = 0; r < rows; r++) g[r] = _mm256_setzero_ps();
    for (int h = 0; h < 2; h++) {
        const __m256i sh = h ? _mm256_permute2x128_si256(s16, s16, 0x11) : _mm256_permute2x128_si256(s16, s16, 0x00);
        __m256i q[4];
        q6k_codes(blk, h, q);
        for (int k = 0; k < 4; k += 2) { /* values 128h + 32k + l: the half's scale 2k for l < 16 (low lane), 2k + 1 above */
            const __m256i low[2] = {_mm256_shuffle_epi8(sh, word_pick(2 * k, 2 * k + 1)),
                                    _mm256_shuffle_epi8(sh, word_pick(2 * k + 2, 2 * k + 3))};
            const __m256i high[2] = {_mm256_slli_epi16(low[0], 8), _mm256_slli_epi16(low[1], 8)};
            for (int r = 0; r < rows; r++) {
                __m256i acc = _mm256_setzero_si256();
                for (int i = 0; i < 2; i++) {
                    const int8_t *p = xp + 2 * (r * in + 128 * h + 32 * (k + i));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k + i], load32(p)), high[i]));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(load32(p + 32), q[k + i]), low[i]));
                }
                g[r] = _mm256_add_ps(g[r], _mm256_cvtepi32_ps(acc));
            }
        }
    }
    q6k_offset(blk, x16, in, rows, g);
}

/* 32 decoded weights times 32 inputs in the planes' lanes (lane i: values 4i..4i+3), before the
 * 64-bit permute that kquant_decoded applies once to its sums (vphaddd works within 128-bit halves). */
static inline __m256i lanes32(const int16_t *w, const int16_t *x) {
    return _mm256_hadd_epi32(_mm256_madd_epi16(load32(w), load32(x)), _mm256_madd_epi16(load32(w + 16), load32(x + 16)));
}

/* A K-quant super-block decoded to int16 (scales folded in; Q6_K's codes as 0..63) against `rows` rows'
 * int16 inputs, into acc (Q4_K: all 256 values) or g (Q6_K: each 64 values to float), as the planes do. */
static inline __attribute__((always_inline)) void kquant_decoded(const int type, const int16_t *w, const int16_t *x,
                                                                 int64_t in, int rows, __m256i *acc, __m256 *g) {
    for (int r = 0; r < rows; r++) {
        const int16_t *xr = x + r * in;
        if (type == TYPE_Q4_K) {
            __m256i sum = lanes32(w, xr);
            for (int c = 1; c < SUBS; c++) sum = _mm256_add_epi32(sum, lanes32(w + 32 * c, xr + 32 * c));
            acc[r] = _mm256_permute4x64_epi64(sum, 0xD8);
            continue;
        }
        g[r] = _mm256_setzero_ps();
        for (int c = 0; c < SUBS; c += 2) {
            const __m256i sum = _mm256_add_epi32(lanes32(w + 32 * c, xr + 32 * c), lanes32(w + 32 * c + 32, xr + 32 * c + 32));
            g[r] = _mm256_add_ps(g[r], _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(sum, 0xD8)));
        }
    }
}

/* row_dot_of's AVX2 form: K-quants on the input's byte planes up to TILE rows (no decoding), against
 * the block decoded once into the L1 cache for more (fewer instructions a row); the same bits either
 * way. Q8_0 decoded, a float factor per block of 32. */
static inline __attribute__((always_inline)) void row_dot_of(const int type, const int most, const uint8_t *wrow,
                                                             int64_t supers, const int16_t *xq, const int8_t *xp,
                                                             const int32_t *x16, const float *xs, const float *xsum,
                                                             int64_t in, int rows, float *out) {
    if (most <= TILE) rows = most; /* a constant for the compiler: loops over rows unrolled */
    __m256 f[most], fm[most];
    for (int r = 0; r < most; r++) {
        f[r] = _mm256_setzero_ps();
        fm[r] = _mm256_setzero_ps();
    }
    const int64_t bytes = gguf_super_bytes(type), per_row = in / SUPER;
    int16_t w[SUPER] __attribute__((aligned(32)));
    for (int64_t b = 0; b < supers; b++) {
        const uint8_t *blk = wrow + b * bytes, *ahead = blk + PREFETCH;
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        float fac[SUBS], mins[SUBS];
        if (type == TYPE_Q8_0) {
            decode_avx2(TYPE_Q8_0, blk, w, fac, mins);
            for (int r = 0; r < rows; r++) {
                const int16_t *x = xq + r * in + b * SUPER;
                for (int j = 0; j < SUBS; j++) {
                    const __m256i acc = _mm256_add_epi32(_mm256_madd_epi16(load32(w + 32 * j), load32(x + 32 * j)),
                                                         _mm256_madd_epi16(load32(w + 32 * j + 16), load32(x + 32 * j + 16)));
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(fac[j] * xs[r * per_row + b]), f[r]);
                }
            }
            continue;
        }
        __m256i acc[most];
        __m256 g[most];
        if (most <= TILE) {
            if (type == TYPE_Q4_K) q4k_planes(blk, xp + 2 * b * SUPER, in, rows, acc);
            else q6k_planes(blk, xp + 2 * b * SUPER, x16 + b * 16, in, rows, g);
        } else {
            decode_avx2(type, blk, w, fac, mins);
            if (type == TYPE_Q6_K) /* back to codes 0..63: add 32 x the scale of each 16 */
                for (int k = 0; k < 16; k++) {
                    __m256i *v = (__m256i *)(w + 16 * k);
                    *v = _mm256_add_epi16(*v, _mm256_set1_epi16((short)(32 * (int8_t)blk[192 + k])));
                }
            kquant_decoded(type, w, xq + b * SUPER, in, rows, acc, g);
            if (type == TYPE_Q6_K) q6k_offset(blk, x16 + b * 16, in, rows, g);
        }
        if (type == TYPE_Q4_K) {
            const __m256i mn = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(q4k_scales16(blk + 4), 1));
            const __m256 mv = _mm256_mul_ps(_mm256_cvtepi32_ps(mn), _mm256_set1_ps(half_load(blk + 2)));
            const float d = half_load(blk);
            for (int r = 0; r < rows; r++) {
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * xs[r * per_row + b]), f[r]);
                fm[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * (in / 32) + b * SUBS), fm[r]);
            }
        } else {
            const float d = half_load(blk + 208);
            for (int r = 0; r < rows; r++) f[r] = _mm256_fmadd_ps(g[r], _mm256_set1_ps(d * xs[r * per_row + b]), f[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = sum8(f[r]) - sum8(fm[r]);
}
#endif

#if GGUF_VNNI512 || GGUF_AVX2
static void row_dot(int type, const uint8_t *wrow, int64_t supers, const int16_t *xq, const int8_t *xp,
                    const int32_t *x16, const float *xs, const float *xsum, int64_t in, int rows, float *out) {
#define ROW_DOT(TYPE, MOST) row_dot_of(TYPE, MOST, wrow, supers, xq, xp, x16, xs, xsum, in, rows, out)
#define ROW_DOTS(MOST)                                                                                   \
    switch (type) {                                                                                      \
    case TYPE_Q4_K: ROW_DOT(TYPE_Q4_K, MOST); break;                                                     \
    case TYPE_Q6_K: ROW_DOT(TYPE_Q6_K, MOST); break;                                                     \
    default: ROW_DOT(TYPE_Q8_0, MOST); break;                                                            \
    }
    switch (rows) { /* up to TILE rows: their count a constant, their sums in registers */
    case 1: ROW_DOTS(1); break;
    case 2: ROW_DOTS(2); break;
    case 3: ROW_DOTS(3); break;
    case 4: ROW_DOTS(TILE); break;
    default: ROW_DOTS(MANY); break;
    }
#undef ROW_DOTS
#undef ROW_DOT
}
#else
static void row_dot(int type, const uint8_t *wrow, int64_t supers, const int16_t *xq, const int8_t *xp,
                    const int32_t *x16, const float *xs, const float *xsum, int64_t in, int rows, float *out) {
    (void)xp, (void)x16;
    float sums[MANY] = {0};
    const int64_t bytes = gguf_super_bytes(type);
    for (int64_t b = 0; b < supers; b++) {
        int16_t w[SUPER];
        float fac[SUBS], mins[SUBS];
        decode_plain(type, wrow + b * bytes, w, fac, mins);
        for (int r = 0; r < rows; r++) {
            const int16_t *x = xq + r * in + b * SUPER;
            for (int j = 0; j < SUBS; j++) {
                int32_t acc = 0, acc1 = 0; /* 16 products each (see the top) */
                for (int l = 0; l < 16; l++) {
                    acc += (int32_t)w[32 * j + l] * x[32 * j + l];
                    acc1 += (int32_t)w[32 * j + 16 + l] * x[32 * j + 16 + l];
                }
                sums[r] += (float)acc1 * (fac[j] * xs[r * (in / SUPER) + b]);
                sums[r] += (float)acc * (fac[j] * xs[r * (in / SUPER) + b]) - mins[j] * xsum[r * (in / 32) + b * SUBS + j];
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r] = sums[r];
}
#endif

/* One super-block's 256 weights as float, in input order (`picks`: scale_picks', with AVX-512). */
#if GGUF_VNNI512
static inline void super_values(int type, const uint8_t *blk, float *v, const __m512i *picks) {
    __m512i w[SUBS];
    float fac[SUBS] = {0}, mins[SUBS] = {0};
    switch (type) { /* a constant type per call of decode_vnni: each inlined alone */
    case TYPE_Q4_K: decode_vnni(TYPE_Q4_K, blk, w, fac, mins, picks); break;
    case TYPE_Q6_K: decode_vnni(TYPE_Q6_K, blk, w, fac, mins, picks); break;
    default: decode_vnni(TYPE_Q8_0, blk, w, fac, mins, picks); break;
    }
    for (int j = 0; j < SUBS; j++) {
        const __m512 d = _mm512_set1_ps(type == TYPE_Q8_0 ? fac[j] : fac[0]), m = _mm512_set1_ps(-mins[j]);
        const __m512i lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(w[j]));
        const __m512i hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w[j], 1));
        _mm512_storeu_ps(v + 32 * j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m));
        _mm512_storeu_ps(v + 32 * j + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m));
    }
}
#define PICKS_DECLARE __m512i picks[2 * SUBS]; scale_picks(picks)
#define PICKS , picks
#else
#if GGUF_AVX2
#define DECODE decode_avx2
#else
#define DECODE decode_plain
#endif
static inline void super_values(int type, const uint8_t *blk, float *v) {
    int16_t w[SUPER];
    float fac[SUBS], mins[SUBS];
    switch (type) { /* a constant type per call: each inlined alone */
    case TYPE_Q4_K: DECODE(TYPE_Q4_K, blk, w, fac, mins); break;
    case TYPE_Q6_K: DECODE(TYPE_Q6_K, blk, w, fac, mins); break;
    default: DECODE(TYPE_Q8_0, blk, w, fac, mins); break;
    }
    for (int j = 0; j < SUBS; j++)
        for (int l = 0; l < 32; l++) v[32 * j + l] = fmaf(fac[j], (float)w[32 * j + l], -mins[j]);
}
#undef DECODE
#define PICKS_DECLARE
#define PICKS
#endif

/* A super-block's values stored at the output's type: float32 as they are; bfloat16 rounded to nearest
 * even (vcvtne2ps2bf16 where the CPU has it: the same bits, the values being normal floats or zero). */
static inline void f32_values_store(float *dst, const float *v) { memcpy(dst, v, SUPER * sizeof *v); }

static inline void bf16_values_store(uint16_t *dst, const float *v) {
#if defined(__AVX512BF16__)
    for (int k = 0; k < SUPER; k += 32)
        _mm512_storeu_si512((void *)(dst + k), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + k + 16), _mm512_loadu_ps(v + k)));
#else
    for (int k = 0; k < SUPER; k++) bf16_store(dst + k, v[k]);
#endif
}

/* Rows `ids` of a quantized matrix decoded (what the kernel multiplies by: the embedding table's
 * lookups, and the tests' reference); `ids` NULL: rows 0..n-1 (a whole matrix, for a batch's GEMM). */
#define DEQUANTIZE_ROWS(NAME, T, STORE)                                                                 \
    void NAME(const uint8_t *wq, int type, const int64_t *ids, int64_t n, int64_t in, T *out, int threads) { \
        const int64_t supers = in / SUPER, bytes = gguf_super_bytes(type), row_bytes = supers * bytes; \
        _Pragma("omp parallel num_threads(threads)") {                                                \
            PICKS_DECLARE;                                                                            \
            float v[SUPER];                                                                           \
            _Pragma("omp for schedule(static)")                                                       \
            for (int64_t i = 0; i < n; i++) {                                                         \
                const uint8_t *row = wq + (ids != NULL ? ids[i] : i) * row_bytes;                     \
                for (int64_t b = 0; b < supers; b++) {                                                \
                    for (int64_t line = 0; line < bytes; line += 64) /* blocks ahead, asked early */  \
                        __builtin_prefetch(row + b * bytes + PREFETCH + line, 0, 3);                  \
                    super_values(type, row + b * bytes, v PICKS);                                     \
                    STORE(out + i * in + b * SUPER, v);                                               \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

DEQUANTIZE_ROWS(gguf_dequantize_rows_f32, float, f32_values_store)
DEQUANTIZE_ROWS(gguf_dequantize_rows_bf16, uint16_t, bf16_values_store)

/* gguf_amx_rows(): from how many rows gguf_linear_bf16 multiplies on AMX tiles here; 0: never. */
#if AMX_BF16
#define GGUF_AMX_ROWS 12 /* bfloat16 batches from this many rows go to the tiles (csrc/gguf_amx.c) */
int gguf_linear_amx(const uint16_t *x, const uint8_t *wq, int type, int64_t row_bytes, const uint16_t *bias,
                    uint16_t *out, int64_t rows, int64_t in, int64_t outs, int64_t out_stride, int threads);
#define AMX_TAKES(rows) ((rows) >= GGUF_AMX_ROWS && amx_allowed())
int gguf_amx_rows(void) { return amx_allowed() ? GGUF_AMX_ROWS : 0; }
#else
#define AMX_TAKES(rows) 0
#define gguf_linear_amx(...) (-2)
int gguf_amx_rows(void) { return 0; }
#endif

/* x [rows, in] (in a multiple of 256) times wq [outs rows of the type's blocks] -> out [rows, outs]
 * written with a row stride of `out_stride` (a fused layer's part writes its columns). Returns 0, -1
 * where the scratch could not be had, -2 for a type or width it does not run. bfloat16 batches of
 * gguf_amx_rows() rows or more: on AMX tiles, the weights decoded to bf16 (csrc/gguf_amx.c). */
#define GGUF_LINEAR(NAME, T, LOAD, STORE, QUANTIZE, TILES)                                               \
    int NAME(const T *x, const uint8_t *wq, int type, const T *bias, T *out, int64_t rows, int64_t in,   \
             int64_t outs, int64_t out_stride, int threads) {                                            \
        if (gguf_super_bytes(type) == 0 || in % SUPER != 0) return -2;                                 \
        const int64_t supers = in / SUPER, row_bytes = supers * gguf_super_bytes(type);                \
        if (TILES && AMX_TAKES(rows))                                                                  \
            return gguf_linear_amx((const uint16_t *)x, wq, type, row_bytes, (const uint16_t *)bias,     \
                                   (uint16_t *)out, rows, in, outs, out_stride, threads);              \
        int16_t *xq = malloc((size_t)(rows * in) * sizeof *xq);                                        \
        float *xs = malloc((size_t)(rows * supers) * sizeof *xs);                                      \
        float *xsum = malloc((size_t)(rows * (in / 32)) * sizeof *xsum);                               \
        int8_t *xp = PLANES ? malloc((size_t)(rows * in * 2 + rows * (in / 16) * 4)) : NULL;           \
        int32_t *x16 = PLANES ? (int32_t *)(xp + rows * in * 2) : NULL; /* each 16 codes' sum */        \
        if (xq == NULL || xs == NULL || xsum == NULL || (PLANES && xp == NULL)) {                      \
            free(xq);                                                                                  \
            free(xs);                                                                                  \
            free(xsum);                                                                                \
            free(xp);                                                                                  \
            return -1;                                                                                 \
        }                                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                              \
        for (int64_t r = 0; r < rows; r++) {                                                           \
            QUANTIZE(x + r * in, xq + r * in, xs + r * supers, xsum + r * (in / 32), in);              \
            if (PLANES) split_planes(xq + r * in, xp + 2 * r * in, x16 + r * (in / 16), in);           \
        }                                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                              \
        for (int64_t n = 0; n < outs; n++) {                                                           \
            const float b = bias != NULL ? LOAD(bias + n) : 0.0f;                                      \
            for (int64_t r = 0; r < rows; r += MANY) {                                                 \
                const int tile = rows - r < MANY ? (int)(rows - r) : MANY;                             \
                float sums[MANY];                                                                      \
                row_dot(type, wq + n * row_bytes, supers, xq + r * in, PLANES ? xp + 2 * r * in : NULL,   \
                        PLANES ? x16 + r * (in / 16) : NULL, xs + r * supers, xsum + r * (in / 32), in, tile, \
                        sums);                                                                         \
                for (int i = 0; i < tile; i++) STORE(out + (r + i) * out_stride + n, sums[i] + b);     \
            }                                                                                          \
        }                                                                                              \
        free(xq);                                                                                      \
        free(xs);                                                                                      \
        free(xsum);                                                                                    \
        free(xp);                                                                                      \
        return 0;                                                                                      \
    }

GGUF_LINEAR(gguf_linear_f32, float, f32_load, f32_store, quantize_row_f32, 0)
GGUF_LINEAR(gguf_linear_bf16, uint16_t, bf16_load, bf16_store, quantize_row_bf16, 1)
