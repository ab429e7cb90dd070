/* A low-precision model's fp32 masters take the elements of its weights changed since a
 * step wrote them from the masters (take_edits in tiermem/optim/offloaded.py). An element
 * is changed when its weight is not its master rounded to nearest even, compared as
 * values, as torch's `!=` compares them (-0 equals +0; a NaN differs from everything, so a
 * NaN weight is taken, and a NaN master stays NaN): its master becomes the weight,
 * widened exactly. Elements left as they were keep their fp32 masters.
 *
 * Why in C: the same rule in torch ops runs five passes with temporaries (4 ns a
 * parameter, fourteen times the bf16 update it comes before; 1 ns chunked); this is one
 * pass that reads 6 bytes an element and writes only what changed, on the update's
 * threads. */
#include <errno.h>
#include <stdint.h>

#include "numeric.h"
#include "parallel.h"
#include "tiermem_native.h"

#define TM_EDITS_PAR_MIN (1 << 20)  /* below this, no threads */
#define TM_EDITS_MAX_THREADS 64

typedef struct edits_job {
    float *m;
    const uint16_t *w;
    int64_t n;
    int f16;
    int64_t taken;
} edits_job;

#if TM_X86
/* fp16 by F16C's conversions (round to nearest even, as f32_to_f16), 8 at a time. */
__attribute__((target("avx2,f16c"))) static int64_t edits_f16c(float *m, const uint16_t *w,
                                                                 int64_t n, int64_t *done)
{
    int64_t taken = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 was = _mm256_loadu_ps(m + i);
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
        __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(was, _MM_FROUND_TO_NEAREST_INT));
        __m256 c = _mm256_cmp_ps(v, r, _CMP_NEQ_UQ);  /* unordered: a NaN differs */
        _mm256_storeu_ps(m + i, _mm256_blendv_ps(was, v, c));
        taken += __builtin_popcount((unsigned)_mm256_movemask_ps(c));
    }
    *done = i;
    return taken;
}
#endif

__attribute__((optimize("O3"))) static void *edits_work(void *arg)
{
    edits_job *j = arg;
    float *m = j->m;
    const uint16_t *w = j->w;
    int64_t taken = 0;
    if (j->f16) {
        int64_t i0 = 0;
#if TM_X86
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
            taken = edits_f16c(m, w, j->n, &i0);
#endif
        for (int64_t i = i0; i < j->n; i++) {
            float v = f16_to_f32(w[i]);
            if (v != f16_to_f32(f32_to_f16(m[i]))) {
                m[i] = v;
                taken++;
            }
        }
    } else {
        /* branch-free, so that the compiler vectorises it: every element is written
         * back, with its own value where it is kept */
        for (int64_t i = 0; i < j->n; i++) {
            float v = bf16_to_f32(w[i]), was = m[i];
            int c = v != bf16_to_f32(f32_to_bf16(was));
            m[i] = c ? v : was;
            taken += c;
        }
    }
    j->taken = taken;
    return NULL;
}

int64_t tm_take_edits(float *master, const uint16_t *weights, int64_t n, int w_dtype,
                      int nthreads)
{
    if (n < 0 || !master || !weights || (w_dtype != 1 && w_dtype != 2))
        return -EINVAL;
    if (nthreads < 1 || n < TM_EDITS_PAR_MIN)
        nthreads = 1;
    if (nthreads > TM_EDITS_MAX_THREADS)
        nthreads = TM_EDITS_MAX_THREADS;
    edits_job jobs[TM_EDITS_MAX_THREADS];
    for (int t = 0; t < nthreads; t++) {
        int64_t b = n * t / nthreads, e = n * (t + 1) / nthreads;
        jobs[t] = (edits_job){master + b, weights + b, e - b, w_dtype == 2, 0};
    }
    tm_parallel_pieces(edits_work, jobs, sizeof(edits_job), nthreads);
    int64_t taken = 0;
    for (int t = 0; t < nthreads; t++)
        taken += jobs[t].taken;
    return taken;
}
