/* Prefill attention for bfloat16 queries over a bfloat16 cache on bfloat16 pair products: paged_prefill.c's
 * tasks (a tile of a chunk's tokens and one KV head, with all the query heads of its group) with its two
 * products computed on pairs of bfloat16 inputs, each pair's two products added to a float32 sum, on
 * AMX tiles (TDPBF16PS) where the CPU has them and Linux grants them, else on 512-bit vectors
 * (AVX512-BF16's VDPBF16PS: the AMD EPYCs of Zen 4 and later, Cooper Lake). For each step of KC keys:
 *  - scores: the task's rows (up to 64) against the keys packed 16 at a time (a key's dims in pairs: a
 *    16 x 16 transpose of 32-bit words, a B tile, or 16 lanes of a vector per pair of dims), summed in
 *    float32 (the products of bfloat16 are exact, only the order of the sums differs from the vector
 *    kernel's), then scaled;
 *  - the online softmax per row in float32, as paged_prefill.c (prefill_common.h);
 *  - weighted values: each float32 weight split into two bfloat16 parts, its rounding and what the
 *    rounding left, each against the values packed in pairs of keys per dim (a B tile, or a vector
 *    of 16 dims), added to the float32 accumulators. The two parts carry ~16 bits of each weight
 *    (one part alone, as flash attention on a GPU rounds them, ~8), for one more product of the few a
 *    step computes: the outputs are the vector kernel's but for a rare last bit (on the 1.5B model's
 *    layers, bf16, on the tiles: mean |difference| 2e-7, the largest one unit of bf16).
 *
 * The packed layouts and the vectors' products are in pair_vectors.h, the tiles' here.
 *
 * Same arguments as paged_prefill_bf16 (paged_prefill.c); head_dim a multiple of 32, at most
 * MAX_HEAD_DIM; the caller asks paged_prefill_pairs_kind() first (2: tiles, 1: vectors, 0: neither
 * built in, and the rows a task may hold: MAX_ROWS on tiles, PAIR_ROWS on vectors) and calls
 * paged_prefill_bf16_amx or paged_prefill_bf16_dot accordingly.
 */
#include "amx_tiles.h"
#include "bf16_vectors.h"
#include "paged_common.h"
#include "pair_vectors.h"
#include "prefill_common.h"

#define PAIR_ROWS 96 /* query rows a task holds on vectors: more rows share each step's packing (of 64, 96 and 128,
                        96 measured fastest on SmolLM2's shapes, chunks of 40-2,048 tokens); the tiles hold MAX_ROWS */

int paged_prefill_pairs_kind(int64_t *rows) {
    *rows = MAX_ROWS;
#if AMX_BF16
    if (amx_allowed()) return 2;
#endif
#if PAIR_PRODUCTS
    *rows = PAIR_ROWS;
    return 1;
#else
    return 0;
#endif
}

#if PAIR_PRODUCTS

/* e^x for 16 lanes: fast_expf's clamp, reduction and polynomial (paged_common.h's EXP_ constants) on
 * 512-bit vectors (the compiler vectorises fast_expf's loops 256 bits wide on these CPUs). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_HIGH)), _mm512_set1_ps(EXP_LOW));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* One row's step of the online softmax (prefill_common.h's, on 512-bit vectors): its KC scores `s`
 * scaled (and capped), [from, to) seen, the running maximum m and sum l updated, acc rescaled, and
 * the weights as two bfloat16 parts into `hi` and `lo`, the A tiles' rows: hi the weight rounded to
 * nearest even, lo the rest rounded. */
static void softmax_row(float *s, uint16_t *hi, uint16_t *lo, int from, int to, float scale, float softcap, float *m,
                        float *l, float *acc, int64_t dim) {
    if (softcap > 0.0f) {
        for (int i = from; i < to; i++) s[i] = softcap * tanhf(s[i] * scale / softcap);
        scale = 1.0f;
    }
    const uint64_t seen = (to >= 64 ? ~0ull : (1ull << to) - 1) & ~((1ull << from) - 1);
    __m512 v[KC / 16], top = _mm512_set1_ps(*m);
    for (int b = 0; b < KC / 16; b++) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * b), _mm512_set1_ps(scale));
        v[b] = _mm512_mask_blend_ps((__mmask16)(seen >> (16 * b)), _mm512_set1_ps(-INFINITY), x);
        top = _mm512_max_ps(top, v[b]);
    }
    const float most = _mm512_reduce_max_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < KC / 16; b += 2) {
        const __m512 p0 = exp16(_mm512_sub_ps(v[b], _mm512_set1_ps(most)));
        const __m512 p1 = exp16(_mm512_sub_ps(v[b + 1], _mm512_set1_ps(most)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512i top16 = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(hi + 16 * b, top16);
        const __m512 r0 = _mm512_sub_ps(p0, bf16x16(_mm512_castsi512_si256(top16)));
        const __m512 r1 = _mm512_sub_ps(p1, bf16x16(_mm512_extracti64x4_epi64(top16, 1)));
        _mm512_storeu_si512(lo + 16 * b, (__m512i)_mm512_cvtne2ps_pbh(r1, r0));
    }
    const float rescale = fast_expf(*m - most);
    *m = most;
    *l = *l * rescale + _mm512_reduce_add_ps(sum);
    for (int64_t d = 0; d < dim; d += 16) /* head_dim: a multiple of 32 */
        _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(rescale)));
}

#if AMX_BF16
/* C tile T (rows 16 * T of the task) += A (qb's rows, dims of chunk c) . B tile 5, for each of
 * `blocks` row blocks: the tile numbers must be constants. */
#define SCORE_BLOCK(T)                                                                               \
    if (blocks > T) {                                                                                \
        _tile_loadd(4, qb + (T) * 16 * head_dim + c * 32, head_dim * 2);                             \
        _tile_dpbf16ps(T, 4, 5);                                                                     \
    }
#define STORE_SCORES(T)                                                                              \
    if (blocks > T) _tile_stored(T, sc + (T) * 16 * KC + g * 16, KC * 4);

/* sc[x][16g..16g + 16) = qb[x] . key 16g + j for the task's row blocks and the step's `groups` key groups. */
static void tile_scores(const uint16_t *qb, uint32_t kt[GROUPS][CHUNKS][16 * 16], float *sc, int64_t blocks,
                        int64_t groups, int64_t head_dim) {
    for (int64_t g = 0; g < groups; g++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < head_dim / 32; c++) {
            _tile_loadd(5, kt[g][c], 64);
            SCORE_BLOCK(0)
            SCORE_BLOCK(1)
            SCORE_BLOCK(2)
            SCORE_BLOCK(3)
        }
        STORE_SCORES(0)
        STORE_SCORES(1)
        STORE_SCORES(2)
        STORE_SCORES(3)
    }
}

/* acc[x] += the weights' two parts (pb, pr) . the values (vp) for the task's row blocks; keys 32-63 where
 * the step has more than 32 (`padded`). */
static void tile_values(const uint16_t *pb, const uint16_t *pr, uint32_t vp[PAIRS][MAX_HEAD_DIM / 16][16 * 16],
                        float *acc, int64_t blocks, int64_t padded, int64_t head_dim) {
    for (int64_t t = 0; t < blocks; t++) {
        _tile_loadd(4, pb + t * 16 * KC, KC * 2); /* the weights' first parts, keys 0-31 of rows 16t.. */
        _tile_loadd(1, pr + t * 16 * KC, KC * 2); /* ... their second parts */
        if (padded > 32) { /* keys 32-63 */
            _tile_loadd(5, pb + t * 16 * KC + 32, KC * 2);
            _tile_loadd(2, pr + t * 16 * KC + 32, KC * 2);
        }
        for (int64_t b = 0; b < head_dim / 16; b++) {
            float *block = acc + t * 16 * head_dim + b * 16;
            _tile_loadd(0, block, head_dim * 4);
            _tile_loadd(6, vp[0][b], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 1, 6);
            if (padded > 32) {
                _tile_loadd(7, vp[1][b], 64);
                _tile_dpbf16ps(0, 5, 7);
                _tile_dpbf16ps(0, 2, 7);
            }
            _tile_stored(0, block, head_dim * 4);
        }
    }
}
#endif

/* One task (`len` tokens from `first`, KV head h) on tiles (`tiles`, the thread's tiles configured) or vectors. */
static void pairs_task(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                       uint16_t *out, int64_t first, int64_t len, int64_t h, int64_t ctx0, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                       float softcap, int tiles) {
    (void)tiles; /* only where the tiles are built in */
    const int64_t group = num_heads / num_kv_heads, rows = len * group, blocks = (rows + 15) / 16;
    const int64_t chunks = head_dim / 32, row_stride = num_kv_heads * head_dim;
    static const uint16_t zeros[MAX_HEAD_DIM]; /* a key and value row past the step's keys */
    uint16_t qb[PAIR_ROWS * MAX_HEAD_DIM], pb[PAIR_ROWS * KC], pr[PAIR_ROWS * KC];
    const uint16_t *krow[KC], *vrow[KC];
    uint32_t kt[GROUPS][CHUNKS][16 * 16], vp[PAIRS][MAX_HEAD_DIM / 16][16 * 16];
    float sc[PAIR_ROWS * KC], acc[PAIR_ROWS * MAX_HEAD_DIM], m[PAIR_ROWS], l[PAIR_ROWS];
    for (int64_t r = 0; r < len; r++) /* the group's heads of a token are consecutive: one copy */
        memcpy(qb + r * group * head_dim, q + ((first + r) * num_heads + h * group) * head_dim,
               (size_t)(group * head_dim) * sizeof *qb);
    memset(qb + rows * head_dim, 0, (size_t)((blocks * 16 - rows) * head_dim) * sizeof *qb);
    memset(pb, 0, sizeof pb); /* rows past `rows` weigh nothing */
    memset(pr, 0, sizeof pr);
    memset(sc, 0, sizeof sc);
    memset(acc, 0, (size_t)(blocks * 16 * head_dim) * sizeof *acc);
    for (int64_t x = 0; x < rows; x++) {
        m[x] = -INFINITY;
        l[x] = 0.0f;
    }
    const int64_t end = ctx0 + len - 1, begin = window > 0 && ctx0 > window ? ctx0 - window : 0;
    for (int64_t start = begin; start < end;) {
        const int64_t n = end - start < KC ? end - start : KC; /* may span blocks */
        for (int64_t i = 0; i < KC; i++) { /* the step's rows in the cache; zeros past its keys */
            const int64_t pos = start + i;
            const int64_t at = i < n ? ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row_stride
                                           + h * head_dim : -1;
            krow[i] = at < 0 ? zeros : k_cache + at;
            vrow[i] = at < 0 ? zeros : v_cache + at;
        }
        const int64_t padded = (n + 31) / 32 * 32;
        for (int64_t g = 0; g < GROUPS; g++) /* keys as B tiles: word p of chunk c of key j at [p][j] */
            for (int64_t c = 0; c < chunks; c++) transpose_words(krow + g * 16, c * 32, kt[g][c]);
        for (int64_t b2 = 0; b2 < padded / 32; b2++) /* values as B tiles: keys 2p, 2p + 1, dim d at [p][d] */
            for (int64_t b = 0; b < head_dim / 16; b++)
                for (int64_t p = 0; p < 16; p++)
                    _mm512_storeu_si512(&vp[b2][b][p * 16], interleave16(vrow[b2 * 32 + 2 * p] + b * 16,
                                                                         vrow[b2 * 32 + 2 * p + 1] + b * 16));
#if AMX_BF16
        if (tiles)
            tile_scores(qb, kt, sc, blocks, (n + 15) / 16, head_dim);
        else
#endif
            vector_scores(qb, kt, sc, (rows + 3) & ~(int64_t)3, head_dim);
        for (int64_t r = 0; r < len; r++) {
            const int64_t ctx = ctx0 + r, lo = window > 0 && ctx > window ? ctx - window : 0;
            for (int64_t gh = 0; gh < group; gh++) {
                const int64_t x = r * group + gh;
                if (start >= ctx || start + n <= lo) { /* nothing this token sees */
                    memset(pb + x * KC, 0, KC * sizeof *pb);
                    memset(pr + x * KC, 0, KC * sizeof *pr);
                    continue;
                }
                const int64_t from = lo > start ? lo - start : 0, to = ctx - start < n ? ctx - start : n;
                softmax_row(sc + x * KC, pb + x * KC, pr + x * KC, (int)from, (int)to, scale, softcap, m + x, l + x,
                            acc + x * head_dim, head_dim);
            }
        }
#if AMX_BF16
        if (tiles)
            tile_values(pb, pr, vp, acc, blocks, padded, head_dim);
        else
#endif
            vector_values(pb, pr, vp, acc, (rows + 3) & ~(int64_t)3, padded, head_dim);
        start += n;
    }
    for (int64_t r = 0; r < len; r++) {
        uint16_t *ot = out + ((first + r) * num_heads + h * group) * head_dim;
        for (int64_t gh = 0; gh < group; gh++) {
            const int64_t x = r * group + gh;
            const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) bf16_store(ot + gh * head_dim + d, acc[x * head_dim + d] * inv);
        }
    }
}
#endif

#define PREFILL_ARGS                                                                                                   \
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,                  \
        int64_t table_stride, const int32_t *tile_first, const int32_t *tile_len, const int32_t *token_seq,            \
        const int32_t *ctx_len, uint16_t *out, int64_t num_tiles, int64_t num_heads, int64_t num_kv_heads,             \
        int64_t head_dim, int64_t block_size, float scale, int64_t window, float softcap, const float *lut,            \
        int num_threads

/* Every task of a call, on the calling threads. */
#define EACH_TASK(TILES)                                                                                               \
    _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                                                \
    for (int64_t tile = 0; tile < num_tiles; tile++)                                                                   \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                                   \
            const int64_t first = tile_first[tile];                                                                    \
            pairs_task(q, k_cache, v_cache, block_tables + (int64_t)token_seq[first] * table_stride, out, first,       \
                       tile_len[tile], h, ctx_len[first], num_heads, num_kv_heads, head_dim, block_size, scale,        \
                       window, softcap, TILES);                                                                        \
        }

#define UNUSED_ARGS                                                                                                    \
    (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_stride, (void)tile_first, (void)tile_len,   \
        (void)token_seq, (void)ctx_len, (void)out, (void)num_tiles, (void)num_heads, (void)num_kv_heads,               \
        (void)head_dim, (void)block_size, (void)scale, (void)window, (void)softcap, (void)num_threads

void paged_prefill_bf16_amx(PREFILL_ARGS) {
    (void)lut;
#if AMX_BF16
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure(AMX_TILE_ROWS);
        EACH_TASK(1)
        _tile_release();
    }
#else
    UNUSED_ARGS;
#endif
}

void paged_prefill_bf16_dot(PREFILL_ARGS) {
    (void)lut;
#if PAIR_PRODUCTS
#pragma omp parallel num_threads(num_threads)
    {
        EACH_TASK(0)
    }
#else
    UNUSED_ARGS;
#endif
}
