/* Paged attention on the CPU, reading K/V through the block table: no gathered, padded or widened
 * copy of any context (the torch reference makes all three).
 *
 * Every query token t attends over the first ctx_len[t] positions of its sequence token_seq[t]:
 * a decode token sees its whole context, a prefill token the positions up to its own (causal);
 * with window > 0 only the last `window` of them (sliding-window attention). softcap > 0 caps each
 * score as softcap * tanh(score / softcap) before the softmax (Gemma 2).
 * One task per (token, KV head) computes all the query heads that share that KV head (GQA),
 * block by block with an online softmax, in float32 whatever the storage type.
 *
 * Layouts (contiguous): q/out [T, Hq, D]; k/v cache [num_blocks, block_size, Hkv, D], or, for a
 * quantized cache (paged_kernels/kv_format.py), uint8 rows [num_blocks, block_size, Hkv, D + 2]: D one-byte
 * codes, decoded through `lut` (256 floats), then the row's bfloat16 scale; block_tables int32
 * [S, table_stride]. Built and loaded by paged_kernels/native_attention.py (ctypes).
 */
#include "paged_common.h"

/* Limits the caller checks before choosing this kernel (paged_kernels/native.py mirrors them). */
int paged_attention_limits(int64_t *head_dim, int64_t *group, int64_t *block_size) {
    *head_dim = MAX_HEAD_DIM;
    *group = MAX_GROUP;
    *block_size = MAX_BLOCK_SIZE;
    return 0;
}

/* T: the type of q and out; C: the cache's element type, EXTRA the elements a row holds past its
 * head_dim values (the scale of a quantized row), ROW the loader of one row.
 * NAME##_task attends one (query token, KV head) pair; it is inlined at the common head sizes as
 * constants (SPECIALISED: the loops over head_dim then unroll and vectorise without remainders), and
 * once more with the caller's value for the rest. */
#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE, C, EXTRA, ROW)                                          \
    static inline __attribute__((always_inline)) void NAME##_task(                                          \
        const T *q, const C *k_cache, const C *v_cache, const int32_t *block_tables, int64_t table_stride,   \
        const int32_t *token_seq, const int32_t *ctx_len, T *out, int64_t t, int64_t h, int64_t num_heads,  \
        int64_t num_kv_heads, const int64_t head_dim, const int64_t group, int64_t block_size, float scale,  \
        int64_t window, float softcap, const float *lut) {                                                  \
        const int64_t width = head_dim + (EXTRA);                                                            \
        const int64_t row_stride = num_kv_heads * width; /* one position to the next in a block */          \
        float qf[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM];                                   \
        float row[MAX_HEAD_DIM], p[MAX_GROUP * MAX_BLOCK_SIZE];                                              \
        float m[MAX_GROUP], l[MAX_GROUP];                                                                    \
        const T *qt = q + (t * num_heads + h * group) * head_dim;                                            \
        for (int64_t i = 0; i < group * head_dim; i++) {                                                     \
            qf[i] = LOAD(qt + i) * scale;                                                                    \
            acc[i] = 0.0f;                                                                                   \
        }                                                                                                    \
        for (int64_t g = 0; g < group; g++) {                                                                \
            m[g] = -INFINITY;                                                                                \
            l[g] = 0.0f;                                                                                     \
        }                                                                                                    \
        const int32_t *table = block_tables + (int64_t)token_seq[t] * table_stride;                          \
        const int64_t ctx = ctx_len[t];                                                                      \
        const int64_t first = window > 0 && ctx > window ? ctx - window : 0;                                 \
        for (int64_t start = first; start < ctx;) {                                                          \
            const int64_t in_block = start % block_size, left = block_size - in_block;                       \
            const int64_t n = ctx - start < left ? ctx - start : left;                                       \
            const int64_t base = (((int64_t)table[start / block_size] * block_size + in_block)               \
                                  * num_kv_heads + h) * width;                                               \
            const C *kb = k_cache + base, *vb = v_cache + base;                                              \
            for (int64_t i = 0; i < n; i++) {                                                                \
                ROW(row, kb + i * row_stride, head_dim, lut);                                                \
                for (int64_t g = 0; g < group; g++) {                                                        \
                    const float *qg = qf + g * head_dim;                                                     \
                    float s = 0.0f;                                                                          \
                    _Pragma("omp simd reduction(+ : s)")                                                     \
                    for (int64_t d = 0; d < head_dim; d++) s += qg[d] * row[d];                              \
                    p[g * block_size + i] = softcap > 0.0f ? softcap * tanhf(s / softcap) : s;               \
                }                                                                                            \
            }                                                                                                \
            for (int64_t g = 0; g < group; g++) {                                                            \
                float *pg = p + g * block_size, top = m[g];                                                  \
                for (int64_t i = 0; i < n; i++) top = pg[i] > top ? pg[i] : top;                             \
                const float rescale = fast_expf(m[g] - top);                                                 \
                float sum = l[g] * rescale;                                                                  \
                _Pragma("omp simd reduction(+ : sum)")                                                       \
                for (int64_t i = 0; i < n; i++) {                                                            \
                    pg[i] = fast_expf(pg[i] - top);                                                          \
                    sum += pg[i];                                                                            \
                }                                                                                            \
                m[g] = top;                                                                                  \
                l[g] = sum;                                                                                  \
                float *ag = acc + g * head_dim;                                                              \
                for (int64_t d = 0; d < head_dim; d++) ag[d] *= rescale;                                     \
            }                                                                                                \
            for (int64_t i = 0; i < n; i++) {                                                                \
                ROW(row, vb + i * row_stride, head_dim, lut);                                                \
                for (int64_t g = 0; g < group; g++) {                                                        \
                    const float w = p[g * block_size + i];                                                   \
                    float *ag = acc + g * head_dim;                                                          \
                    _Pragma("omp simd")                                                                      \
                    for (int64_t d = 0; d < head_dim; d++) ag[d] += w * row[d];                              \
                }                                                                                            \
            }                                                                                                \
            start += n;                                                                                      \
        }                                                                                                    \
        T *ot = out + (t * num_heads + h * group) * head_dim;                                                \
        for (int64_t g = 0; g < group; g++) {                                                                \
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;                                              \
            for (int64_t d = 0; d < head_dim; d++) STORE(ot + g * head_dim + d, acc[g * head_dim + d] * inv); \
        }                                                                                                    \
    }                                                                                                        \
    void NAME(const T *q, const C *k_cache, const C *v_cache, const int32_t *block_tables,                   \
              int64_t table_stride, const int32_t *token_seq, const int32_t *ctx_len, T *out,                \
              int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                 \
              int64_t block_size, float scale, int64_t window, float softcap, const float *lut,              \
              int num_threads) {                                                                             \
        const int64_t group = num_heads / num_kv_heads;                                                      \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                \
        for (int64_t t = 0; t < num_tokens; t++) {                                                           \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                     \
                SPECIALISED(NAME##_task, (q, k_cache, v_cache, block_tables, table_stride,  \
                            token_seq, ctx_len, out, t, h, num_heads, num_kv_heads, head_dim, group,          \
                            block_size, scale, window, softcap, lut));                                        \
            }                                                                                                \
        }                                                                                                    \
    }

FOR_EACH_LAYOUT(DEFINE_PAGED_ATTENTION, paged_attention)
