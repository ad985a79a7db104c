/* Prefill attention on the CPU over the paged cache, a tile of query tokens per task.
 *
 * paged_attention.c gives every query token its own task, so a chunk of T tokens reads each cached
 * row up to T times and computes each score as a 64-element dot product (a horizontal sum per
 * score). Here a task takes a tile: up to `tile_len` consecutive tokens of one sequence (positions
 * ctx0 - 1, ctx0, ...: token r sees the first ctx0 + r positions) and one KV head, with all the query
 * heads of its group: rows = tile_len x group, at most MAX_ROWS. Keys are read KC at a time, once per
 * tile, decoded and transposed to [head_dim][KC], so a row's KC scores are head_dim multiply-adds of
 * one vector each; values are read once per tile too. Online softmax per row, in float32 whatever
 * the storage type; window > 0 and softcap > 0 as in paged_attention.c.
 *
 * Layouts as in paged_attention.c; tile_first/tile_len int32 [num_tiles] (the caller splits each
 * sequence's chunk into tiles of at most MAX_ROWS / group tokens), token_seq/ctx_len int32 [T].
 */
#include "paged_common.h"
#include "prefill_common.h"

int paged_prefill_limits(int64_t *rows) {
    *rows = MAX_ROWS;
    return 0;
}

/* s[x][0..KC) = q[x] . key i for `rows` rows (a multiple of 4) of q ([rows][dim]) against kt ([dim][KC], the keys
 * transposed): four rows at a time, so four independent chains of multiply-adds share each load. */
static inline void tile_scores(const float *q, int64_t rows, const float *kt, int64_t dim, float *s) {
    for (int64_t x = 0; x < rows; x += 4) {
        float a0[KC] = {0}, a1[KC] = {0}, a2[KC] = {0}, a3[KC] = {0};
        const float *q0 = q + x * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
        for (int64_t d = 0; d < dim; d++) {
            const float *kd = kt + d * KC;
            const float b0 = q0[d], b1 = q1[d], b2 = q2[d], b3 = q3[d];
            _Pragma("omp simd")
            for (int i = 0; i < KC; i++) {
                a0[i] += b0 * kd[i];
                a1[i] += b1 * kd[i];
                a2[i] += b2 * kd[i];
                a3[i] += b3 * kd[i];
            }
        }
        memcpy(s + x * KC, a0, sizeof a0);
        memcpy(s + (x + 1) * KC, a1, sizeof a1);
        memcpy(s + (x + 2) * KC, a2, sizeof a2);
        memcpy(s + (x + 3) * KC, a3, sizeof a3);
    }
}

/* acc[x] += sum_i p[x][i] v[i] for `rows` rows, an even number (acc [rows][dim], p [rows][KC], v
 * [n][dim]): two rows over 32 channels at a time, four chains of multiply-adds kept in registers
 * through the keys. */
static inline void tile_values(float *acc, const float *p, int64_t rows, const float *v, int64_t n, int64_t dim) {
    for (int64_t x = 0; x < rows; x += 2) {
        float *acc0 = acc + x * dim, *acc1 = acc0 + dim;
        const float *p0 = p + x * KC, *p1 = p0 + KC;
        int64_t d = 0;
        for (; d + 32 <= dim; d += 32) {
            float a0[16], a1[16], c0[16], c1[16];
            memcpy(a0, acc0 + d, sizeof a0);
            memcpy(a1, acc0 + d + 16, sizeof a1);
            memcpy(c0, acc1 + d, sizeof c0);
            memcpy(c1, acc1 + d + 16, sizeof c1);
            for (int64_t i = 0; i < n; i++) {
                const float *vi = v + i * dim + d;
                const float w0 = p0[i], w1 = p1[i];
                _Pragma("omp simd")
                for (int j = 0; j < 16; j++) {
                    a0[j] += w0 * vi[j];
                    a1[j] += w0 * vi[j + 16];
                    c0[j] += w1 * vi[j];
                    c1[j] += w1 * vi[j + 16];
                }
            }
            memcpy(acc0 + d, a0, sizeof a0);
            memcpy(acc0 + d + 16, a1, sizeof a1);
            memcpy(acc1 + d, c0, sizeof c0);
            memcpy(acc1 + d + 16, c1, sizeof c1);
        }
        for (; d < dim; d++)
            for (int64_t i = 0; i < n; i++) {
                acc0[d] += p0[i] * v[i * dim + d];
                acc1[d] += p1[i] * v[i * dim + d];
            }
    }
}

#define DEFINE_PAGED_PREFILL(NAME, T, LOAD, STORE, C, EXTRA, ROW)                                             \
    void NAME(const T *q, const C *k_cache, const C *v_cache, const int32_t *block_tables,                    \
              int64_t table_stride, const int32_t *tile_first, const int32_t *tile_len,                       \
              const int32_t *token_seq, const int32_t *ctx_len, T *out, int64_t num_tiles, int64_t num_heads, \
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,        \
              float softcap, const float *lut, int num_threads) {                                             \
        const int64_t group = num_heads / num_kv_heads;                                                       \
        const int64_t width = head_dim + (EXTRA);                                                             \
        const int64_t row_stride = num_kv_heads * width;                                                      \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                 \
        for (int64_t tile = 0; tile < num_tiles; tile++) {                                                    \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                      \
                float qf[MAX_ROWS * MAX_HEAD_DIM], acc[MAX_ROWS * MAX_HEAD_DIM];                              \
                float kt[MAX_HEAD_DIM * KC], vr[KC * MAX_HEAD_DIM], row[MAX_HEAD_DIM];                        \
                float m[MAX_ROWS], l[MAX_ROWS], sc[MAX_ROWS * KC], pr[MAX_ROWS * KC];                         \
                const int64_t first = tile_first[tile], len = tile_len[tile], rows = len * group;             \
                const int64_t padded = (rows + 3) & ~(int64_t)3; /* rows past `rows`: zero queries, no weight */ \
                for (int64_t r = 0; r < len; r++) {                                                           \
                    const T *qt = q + ((first + r) * num_heads + h * group) * head_dim;                       \
                    for (int64_t i = 0; i < group * head_dim; i++) qf[r * group * head_dim + i] = LOAD(qt + i) * scale; \
                }                                                                                             \
                for (int64_t i = rows * head_dim; i < padded * head_dim; i++) qf[i] = 0.0f;                   \
                for (int64_t i = 0; i < padded * head_dim; i++) acc[i] = 0.0f;                                \
                for (int64_t i = rows * KC; i < padded * KC; i++) pr[i] = 0.0f;                               \
                for (int64_t i = 0; i < rows; i++) {                                                          \
                    m[i] = -INFINITY;                                                                         \
                    l[i] = 0.0f;                                                                              \
                }                                                                                             \
                const int32_t *table = block_tables + (int64_t)token_seq[first] * table_stride;               \
                const int64_t ctx0 = ctx_len[first], end = ctx0 + len - 1;                                    \
                const int64_t begin = window > 0 && ctx0 > window ? ctx0 - window : 0;                        \
                for (int64_t start = begin; start < end;) {                                                   \
                    const int64_t n = end - start < KC ? end - start : KC; /* may span blocks */             \
                    for (int64_t i = 0; i < n; i++) {                                                         \
                        const int64_t pos = start + i;                                                        \
                        const int64_t at = (((int64_t)table[pos / block_size] * block_size + pos % block_size) \
                                            * num_kv_heads + h) * width;                                      \
                        ROW(row, k_cache + at, head_dim, lut);                                                \
                        for (int64_t d = 0; d < head_dim; d++) kt[d * KC + i] = row[d];                       \
                        ROW(vr + i * head_dim, v_cache + at, head_dim, lut);                                  \
                    }                                                                                         \
                    for (int64_t i = n; i < KC; i++)                                                          \
                        for (int64_t d = 0; d < head_dim; d++) kt[d * KC + i] = 0.0f;                         \
                    tile_scores(qf, padded, kt, head_dim, sc);                                                  \
                    for (int64_t r = 0; r < len; r++) {                                                       \
                        const int64_t ctx = ctx0 + r, lo = window > 0 && ctx > window ? ctx - window : 0;    \
                        for (int64_t g = 0; g < group; g++) {                                                 \
                            const int64_t x = r * group + g;                                                  \
                            float *p = pr + x * KC;                                                           \
                            if (start >= ctx || start + n <= lo) { /* nothing this token sees */             \
                                for (int64_t i = 0; i < KC; i++) p[i] = 0.0f;                                 \
                                continue;                                                                     \
                            }                                                                                 \
                            /* seen: key positions [lo, ctx) of this chunk's [start, start + n) */            \
                            const int64_t from = lo > start ? lo - start : 0, to = ctx - start < n ? ctx - start : n; \
                            online_softmax(sc + x * KC, p, from, to, softcap, m + x, l + x, acc + x * head_dim, head_dim); \
                        }                                                                                     \
                    }                                                                                         \
                    tile_values(acc, pr, padded, vr, n, head_dim);                                              \
                    start += n;                                                                               \
                }                                                                                             \
                for (int64_t r = 0; r < len; r++) {                                                           \
                    T *ot = out + ((first + r) * num_heads + h * group) * head_dim;                           \
                    for (int64_t g = 0; g < group; g++) {                                                     \
                        const int64_t x = r * group + g;                                                      \
                        const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;                                   \
                        for (int64_t d = 0; d < head_dim; d++) STORE(ot + g * head_dim + d, acc[x * head_dim + d] * inv); \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

FOR_EACH_LAYOUT(DEFINE_PAGED_PREFILL, paged_prefill)
