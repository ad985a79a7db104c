/* Prefill attention for bfloat16 queries over a bfloat16 cache on AMX tiles: paged_prefill.c's tasks
 * (a tile of a chunk's tokens and one KV head, with all the query heads of its group) with its two
 * products on tiles. For each step of KC keys:
 *  - scores: the task's rows (up to 64: four A tiles of 16 rows, 32 dims each) against the keys packed
 *    as B tiles (16 keys, 32 dims each: a key's dims in pairs, a 16 x 16 transpose of 32-bit words),
 *    summed in float32 (the products of bfloat16 are exact, only the order of the sums differs from
 *    the vector kernel's), then scaled;
 *  - the online softmax per row in float32, as paged_prefill.c (prefill_common.h);
 *  - weighted values: each float32 weight split into two bfloat16 parts, its rounding and what the
 *    rounding left (A tiles of 16 rows, 32 keys, twice), against the values packed as B tiles (pairs
 *    of keys interleaved per dim), added to the float32 accumulators in place. The two parts carry
 *    ~16 bits of each weight (one part alone, as flash attention on a GPU rounds them, ~8), for one
 *    more product of the few a step computes: the outputs are the vector kernel's but for a rare last
 *    bit (on the 1.5B model's layers, bf16: mean |difference| 2e-7, the largest one unit of bf16).
 *
 * Same arguments as paged_prefill_bf16 (paged_prefill.c); head_dim a multiple of 32, at most
 * MAX_HEAD_DIM; the caller checks paged_prefill_amx_ready() first (tiles built in, and granted).
 */
#include "amx_tiles.h"
#include "paged_common.h"
#include "prefill_common.h"

int paged_prefill_amx_ready(void) {
#if AMX_BF16
    return amx_allowed();
#else
    return 0;
#endif
}

#if AMX_BF16
#define GROUPS (KC / 16)          /* B tiles of 16 keys per step (scores) */
#define PAIRS (KC / 32)           /* A and B tiles of 32 keys per step (weighted values) */
#define CHUNKS (MAX_HEAD_DIM / 32) /* 32 dims per A tile row */

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

/* C tile T (rows 16 * T of the task) += A (qb's rows, dims of chunk c) . B tile 5, for each of
 * `blocks` row blocks: the tile numbers must be constants. */
#define SCORE_BLOCK(T)                                                                               \
    if (blocks > T) {                                                                                \
        _tile_loadd(4, qb + (T) * 16 * head_dim + c * 32, head_dim * 2);                             \
        _tile_dpbf16ps(T, 4, 5);                                                                     \
    }
#define STORE_SCORES(T)                                                                              \
    if (blocks > T) _tile_stored(T, sc + (T) * 16 * KC + g * 16, KC * 4);

static void amx_task(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                     uint16_t *out, int64_t first, int64_t len, int64_t h, int64_t ctx0, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                     float softcap) {
    const int64_t group = num_heads / num_kv_heads, rows = len * group, blocks = (rows + 15) / 16;
    const int64_t chunks = head_dim / 32, words = head_dim / 2, row_stride = num_kv_heads * head_dim;
    uint16_t qb[MAX_ROWS * MAX_HEAD_DIM], pb[MAX_ROWS * KC], pr[MAX_ROWS * KC], vs[KC * MAX_HEAD_DIM];
    uint32_t ks[KC * MAX_HEAD_DIM / 2]; /* keys read as words (pairs of dims): stored as words, no type punning */
    uint32_t kt[GROUPS][CHUNKS][16 * 16], vp[PAIRS][MAX_HEAD_DIM / 16][16 * 16];
    float sc[MAX_ROWS * KC], acc[MAX_ROWS * MAX_HEAD_DIM], m[MAX_ROWS], l[MAX_ROWS];
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
        for (int64_t i = 0; i < n; i++) {
            const int64_t pos = start + i;
            const int64_t at = ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row_stride + h * head_dim;
            memcpy(ks + i * words, k_cache + at, (size_t)head_dim * sizeof *k_cache);
            memcpy(vs + i * head_dim, v_cache + at, (size_t)head_dim * sizeof *vs);
        }
        const int64_t padded = (n + 31) / 32 * 32;
        memset(ks + n * words, 0, (size_t)((padded - n) * words) * sizeof *ks);
        memset(vs + n * head_dim, 0, (size_t)((padded - n) * head_dim) * sizeof *vs);
        /* keys as B tiles: word p (dims 2p, 2p + 1 of chunk c) of key j at [p][j] */
        for (int64_t g = 0; g < (n + 15) / 16; g++)
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t p = 0; p < 16; p++)
                    for (int64_t j = 0; j < 16; j++) kt[g][c][p * 16 + j] = ks[(g * 16 + j) * words + c * 16 + p];
        /* values as B tiles: keys 2p and 2p + 1 of a 32-key pair block, dim d of block b, at [p][d] */
        for (int64_t b2 = 0; b2 < padded / 32; b2++)
            for (int64_t b = 0; b < head_dim / 16; b++)
                for (int64_t p = 0; p < 16; p++) {
                    const uint16_t *even = vs + (b2 * 32 + 2 * p) * head_dim + b * 16, *odd = even + head_dim;
                    for (int64_t d = 0; d < 16; d++) vp[b2][b][p * 16 + d] = (uint32_t)even[d] | (uint32_t)odd[d] << 16;
                }
        for (int64_t g = 0; g < (n + 15) / 16; g++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < chunks; c++) {
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

void paged_prefill_bf16_amx(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *tile_first,
                            const int32_t *tile_len, const int32_t *token_seq, const int32_t *ctx_len, uint16_t *out,
                            int64_t num_tiles, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t window, float softcap, const float *lut,
                            int num_threads) {
    (void)lut;
#if AMX_BF16
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure(AMX_TILE_ROWS);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t tile = 0; tile < num_tiles; tile++)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t first = tile_first[tile];
                amx_task(q, k_cache, v_cache, block_tables + (int64_t)token_seq[first] * table_stride, out, first,
                         tile_len[tile], h, ctx_len[first], num_heads, num_kv_heads, head_dim, block_size, scale,
                         window, softcap);
            }
        _tile_release();
    }
#else
    (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_stride, (void)tile_first, (void)tile_len;
    (void)token_seq, (void)ctx_len, (void)out, (void)num_tiles, (void)num_heads, (void)num_kv_heads, (void)head_dim;
    (void)block_size, (void)scale, (void)window, (void)softcap, (void)num_threads;
#endif
}
