/* A GGUF linear layer with its input taken to int8, as llama.cpp takes it for the K-quants (its Q8_K):
 * out[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]), w[n, :] one row of the file's Q4_K or Q6_K blocks,
 * untouched (worker/runner/cpu/gguf_linear.py picks this kernel or csrc/gguf_linear.c's int16 one).
 *
 * Each row of x is taken to int8 per super-block of 256 inputs (absmax / 127), so the weights need no
 * decoding to wider integers: vpmaddubsw multiplies a block's 4- or 6-bit codes, as unsigned bytes, by
 * the input bytes (pairs summed in int16: at most 2 * 63 * 127), vpdpwssd multiplies those by the
 * sub-block scales into int32 lanes, and a super-block's sum is scaled once in float. Q4_K's minimums
 * and Q6_K's offset of 32 come from each sub-block's input sum (kept per row beside its bytes). About
 * half the instructions of the int16 path at one row, and half the input bytes per row of a batch; the
 * price is the input's resolution, 1/127 of its super-block's largest value instead of 1/32767
 * (docs/engine.md measures what that costs in perplexity). A row's result depends on that row alone.
 *
 * The input bytes are stored in the order the blocks' codes come out of a 64-byte load: Q4_K's low
 * nibbles of bytes 0-63 are sub-blocks 0 and 2, the high nibbles 1 and 3 (then 4-7 alike), so a row's
 * super-block is kept as sub-blocks 0 2 1 3 4 6 5 7; Q6_K's codes come out in input order.
 *
 * AVX-512 (BW, VNNI) only: elsewhere every call returns -2 and the int16 kernel runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "gguf_blocks.h"
#include "paged_common.h"

#define ROWS_TILE 4  /* rows whose sums stay in registers */
#define ROWS_MANY 16 /* rows against one super-block's codes, their sums in the L1 cache */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); /* in place (see csrc/int8_linear.c) */
    return acc;
}

/* Where input k of a super-block is kept (the order above). */
static inline int x8_place(int type, int k) {
    if (type != TYPE_Q4_K) return k;
    const int sub = k / 32, pos[SUBS] = {0, 2, 1, 3, 4, 6, 5, 7};
    return 32 * pos[sub] + k % 32;
}

/* One row of x in int8: q[in] in x8_place order, xs[in / 256] scales, sums[in / 16] each 16 inputs' sum
 * of codes (in input order; Q4_K adds pairs of them). Each super-block is read at float once, as LOAD
 * gives it. */
#define QUANTIZE_ROW8(NAME, T, LOAD)                                                                     \
    static void NAME(int type, const T *x, int8_t *q, float *xs, int16_t *sums, int64_t in) {            \
        for (int64_t b = 0; b < in / SUPER; b++) {                                                      \
            float v[SUPER], top = 0.0f;                                                                 \
            for (int k = 0; k < SUPER; k++) {                                                           \
                v[k] = LOAD(x + b * SUPER + k);                                                         \
                top = fmaxf(top, fabsf(v[k]));                                                          \
            }                                                                                           \
            const float scale = top > 0.0f ? top / 127.0f : 1.0f, inv = 1.0f / scale;                  \
            xs[b] = scale;                                                                              \
            for (int g = 0; g < SUPER / 16; g++) {                                                      \
                int sum = 0;                                                                            \
                for (int l = 0; l < 16; l++) {                                                          \
                    const int k = 16 * g + l;                                                           \
                    const float c = nearbyintf(v[k] * inv);                                             \
                    const int8_t code = (int8_t)(c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c));    \
                    q[b * SUPER + x8_place(type, k)] = code;                                            \
                    sum += code;                                                                        \
                }                                                                                       \
                sums[b * (SUPER / 16) + g] = (int16_t)sum;                                              \
            }                                                                                           \
        }                                                                                               \
    }

QUANTIZE_ROW8(quantize_row8_f32, float, f32_load)
QUANTIZE_ROW8(quantize_row8_bf16, uint16_t, bf16_load)

/* Index vectors for vpermw: Q4_K's four registers of codes (sub-blocks 0|2, 1|3, 4|6, 5|7: scale a in
 * lanes 0-15, b in 16-31); Q6_K's four (64 codes, four sub-blocks of 16: eight lanes each). */
static void q4k_picks(__m512i p[4]) {
    const short subs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int k = 0; k < 4; k++) p[k] = _mm512_mask_set1_epi16(_mm512_set1_epi16(subs[k][0]), 0xFFFF0000u, subs[k][1]);
}

static void q6k_picks(__m512i p[4]) {
    for (int k = 0; k < 4; k++) {
        short idx[32];
        for (int l = 0; l < 32; l++) idx[l] = (short)(4 * k + l / 8);
        p[k] = _mm512_loadu_si512(idx);
    }
}

/* One super-block's codes as bytes (four registers of 64) and its scales spread to the int16 lanes
 * the codes' pairs land in; Q4_K: the minimums as int16 (8) too. */
static inline __attribute__((always_inline)) void codes_of(const int type, const uint8_t *blk, const __m512i picks[4],
                                                           __m512i c[4], __m512i s[4], __m128i *mins, float *d, float *dmin) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    if (type == TYPE_Q4_K) {
        const __m256i sm = q4k_scales16(blk + 4);
        for (int k = 0; k < 4; k++) s[k] = _mm512_permutexvar_epi16(picks[k], _mm512_castsi256_si512(sm));
        *mins = _mm256_extracti128_si256(sm, 1);
        for (int z = 0; z < 2; z++) {
            const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * z);
            c[2 * z] = _mm512_and_si512(v, nibble);
            c[2 * z + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        *d = half_load(blk);
        *dmin = half_load(blk + 2);
    } else { /* Q6_K: half h's 64 bytes of low 4 bits and 32 of high 2 bits give codes 128h + [0, 64) and [64, 128) */
        const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
        for (int k = 0; k < 4; k++) s[k] = _mm512_permutexvar_epi16(picks[k], scales);
        const __m512i two = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            c[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, nibble), _mm512_and_si512(_mm512_slli_epi16(hz, 4), two));
            c[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble), _mm512_and_si512(hz, two));
        }
        *d = half_load(blk + 208);
    }
}

/* One output row against `rows` (<= `most`) rows of x: out[r] for r < rows (inlined per type and
 * `most`, both constants). */
static inline __attribute__((always_inline)) void row_dot8_of(const int type, const int most, const uint8_t *wrow,
                                                              int64_t supers, const int8_t *xq, const float *xs,
                                                              const int16_t *sums, int64_t in, int rows, float *out) {
    __m512 f[most];
    __m128 fm[most];
    for (int r = 0; r < most; r++) {
        f[r] = _mm512_setzero_ps();
        fm[r] = _mm_setzero_ps();
    }
    __m512i picks[4];
    if (type == TYPE_Q4_K) q4k_picks(picks);
    else q6k_picks(picks);
    const int64_t bytes = gguf_super_bytes(type), groups = in / 16;
    for (int64_t b = 0; b < supers; b++) {
        const uint8_t *blk = wrow + b * bytes;
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)blk + PREFETCH + line, _MM_HINT_T0);
        __m512i c[4], s[4];
        __m128i mins = _mm_setzero_si128();
        float d, dmin = 0.0f;
        codes_of(type, blk, picks, c, s, &mins, &d, &dmin);
        __m256i scales16 = _mm256_setzero_si256();
        if (type == TYPE_Q6_K) scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        for (int r = 0; r < rows; r++) {
            const int8_t *x = xq + r * in + b * SUPER;
            const int16_t *g = sums + r * groups + b * (SUPER / 16);
            __m512i acc = _mm512_madd_epi16(_mm512_maddubs_epi16(c[0], _mm512_loadu_si512(x)), s[0]);
            for (int k = 1; k < 4; k++) acc = dpwssd(acc, _mm512_maddubs_epi16(c[k], _mm512_loadu_si512(x + 64 * k)), s[k]);
            const float xscale = xs[r * (in / SUPER) + b];
            if (type == TYPE_Q4_K) { /* minimums times each sub-block's input sum (two groups of 16 each) */
                const __m256i g16 = _mm256_loadu_si256((const __m256i *)g);
                const __m256i pairs = _mm256_hadd_epi16(g16, g16); /* each 128-bit half: its four sub-blocks, twice */
                const __m128i sub = _mm_unpacklo_epi64(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
                fm[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, sub)), _mm_set1_ps(dmin * xscale), fm[r]);
            } else { /* the codes' offset of 32: each sub-block's scale times its input sum, 32 times */
                const __m256i off = _mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i *)g));
                acc = _mm512_sub_epi32(acc, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
            }
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d * xscale), f[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m128 m = _mm_hadd_ps(fm[r], fm[r]);
        m = _mm_hadd_ps(m, m);
        out[r] = _mm512_reduce_add_ps(f[r]) - _mm_cvtss_f32(m);
    }
}

static void row_dot8(int type, const uint8_t *wrow, int64_t supers, const int8_t *xq, const float *xs,
                     const int16_t *sums, int64_t in, int rows, float *out) {
#define ROW_DOT8(TYPE, MOST) row_dot8_of(TYPE, MOST, wrow, supers, xq, xs, sums, in, rows, out)
#define ROW_DOTS8(MOST)                                                                                  \
    if (type == TYPE_Q4_K) ROW_DOT8(TYPE_Q4_K, MOST);                                                    \
    else ROW_DOT8(TYPE_Q6_K, MOST);
    switch (rows) { /* up to ROWS_TILE rows: their count a constant, their sums in registers */
    case 1: ROW_DOTS8(1); break;
    case 2: ROW_DOTS8(2); break;
    case 3: ROW_DOTS8(3); break;
    case 4: ROW_DOTS8(ROWS_TILE); break;
    default: ROW_DOTS8(ROWS_MANY); break;
    }
#undef ROW_DOTS8
#undef ROW_DOT8
}

#define X8_RUNS 1
#else
#define X8_RUNS 0
#define QUANTIZE_ROW8(NAME, T)                                                                          \
    static void NAME(int type, const T *x, int8_t *q, float *xs, int16_t *sums, int64_t in) {            \
        (void)type, (void)x, (void)q, (void)xs, (void)sums, (void)in;                                   \
    }
QUANTIZE_ROW8(quantize_row8_f32, float)
QUANTIZE_ROW8(quantize_row8_bf16, uint16_t)
static void row_dot8(int type, const uint8_t *wrow, int64_t supers, const int8_t *xq, const float *xs,
                     const int16_t *sums, int64_t in, int rows, float *out) {
    (void)type, (void)wrow, (void)supers, (void)xq, (void)xs, (void)sums, (void)in, (void)rows, (void)out;
}
#endif

/* 1 where this build runs gguf_linear_x8 (AVX-512 BW and VNNI); 0: every call returns -2. */
int gguf_x8_runs(void) { return X8_RUNS; }

/* x [rows, in] (in a multiple of 256) times wq [outs rows of Q4_K or Q6_K blocks] -> out [rows, outs]
 * written with a row stride of `out_stride`. Returns 0, -1 where the scratch could not be had, -2 for a
 * type, width or CPU it does not run (the int16 kernel's cases: csrc/gguf_linear.c). */
#define GGUF_LINEAR_X8(NAME, T, LOAD, STORE, QUANTIZE)                                                    \
    int NAME(const T *x, const uint8_t *wq, int type, const T *bias, T *out, int64_t rows, int64_t in,    \
             int64_t outs, int64_t out_stride, int threads) {                                             \
        if (!X8_RUNS || (type != TYPE_Q4_K && type != TYPE_Q6_K) || in % SUPER != 0) return -2;         \
        const int64_t supers = in / SUPER, row_bytes = supers * gguf_super_bytes(type);                 \
        int8_t *xq = malloc((size_t)(rows * in));                                                       \
        float *xs = malloc((size_t)(rows * supers) * sizeof *xs);                                       \
        int16_t *sums = malloc((size_t)(rows * (in / 16)) * sizeof *sums);                              \
        if (xq == NULL || xs == NULL || sums == NULL) {                                                 \
            free(xq);                                                                                   \
            free(xs);                                                                                   \
            free(sums);                                                                                 \
            return -1;                                                                                  \
        }                                                                                               \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
        for (int64_t r = 0; r < rows; r++)                                                              \
            QUANTIZE(type, x + r * in, xq + r * in, xs + r * supers, sums + r * (in / 16), in);         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
        for (int64_t n = 0; n < outs; n++) {                                                            \
            const float b = bias != NULL ? LOAD(bias + n) : 0.0f;                                       \
            for (int64_t r = 0; r < rows; r += ROWS_MANY) {                                             \
                const int tile = rows - r < ROWS_MANY ? (int)(rows - r) : ROWS_MANY;                    \
                float acc[ROWS_MANY];                                                                   \
                row_dot8(type, wq + n * row_bytes, supers, xq + r * in, xs + r * supers, sums + r * (in / 16), \
                         in, tile, acc);                                                                \
                for (int i = 0; i < tile; i++) STORE(out + (r + i) * out_stride + n, acc[i] + b);       \
            }                                                                                           \
        }                                                                                               \
        free(xq);                                                                                       \
        free(xs);                                                                                       \
        free(sums);                                                                                     \
        return 0;                                                                                       \
    }

GGUF_LINEAR_X8(gguf_linear_x8_f32, float, f32_load, f32_store, quantize_row8_f32)
GGUF_LINEAR_X8(gguf_linear_x8_bf16, uint16_t, bf16_load, bf16_store, quantize_row8_bf16)
