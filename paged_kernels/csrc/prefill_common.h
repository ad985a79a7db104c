/* What the prefill kernels share, paged_prefill.c (vectors) and paged_prefill_bf16.c (pair products): a
 * task's rows at most, keys per step, and the online softmax, a row and KC keys at a time.
 */
#ifndef PREFILL_COMMON_H
#define PREFILL_COMMON_H

#include "paged_common.h"

#define KC 64       /* keys per inner step: four AVX-512 vectors of float32 scores */
#define MAX_ROWS 64 /* query rows (tokens x the group's heads) a task holds */

/* One row's step of the online softmax over a chunk of KC scores `s`, of which [from, to) are seen
 * (the rest weigh nothing): softcap, the running maximum m and sum l updated, acc rescaled to the new
 * maximum, and the chunk's weights into `p` for the weighted values. */
/* Not inlined: one copy for the kernels of a file (inlined, it measured no faster). */
static __attribute__((noinline, unused)) void online_softmax(float *restrict s, float *restrict p, int from, int to, float softcap, float *m, float *l,
                                  float *restrict acc, int64_t dim) {
    if (softcap > 0.0f)
        for (int64_t i = from; i < to; i++) s[i] = softcap * tanhf(s[i] / softcap);
    float top = *m;
    _Pragma("omp simd reduction(max : top)")
    for (int i = 0; i < KC; i++) {
        s[i] = i >= from && i < to ? s[i] : -INFINITY; /* weighs ~1e-38 below (fast_expf's clamp): nothing */
        top = s[i] > top ? s[i] : top;
    }
    float sum = 0.0f;
    _Pragma("omp simd reduction(+ : sum)")
    for (int i = 0; i < KC; i++) {
        p[i] = fast_expf(s[i] - top);
        sum += p[i];
    }
    const float rescale = fast_expf(*m - top);
    *m = top;
    *l = *l * rescale + sum;
    _Pragma("omp simd")
    for (int64_t d = 0; d < dim; d++) acc[d] *= rescale;
}

#endif
