/* SGD (momentum, dampening, nesterov, weight decay, maximize) and Adagrad
 * (lr_decay, weight decay, eps, maximize) on fp32 runs, in one pass that also
 * returns the CRC32C of the state it wrote (and optionally of the parameters).
 *
 * Why: the tiered step of these optimizers ran torch's kernels per partition
 * and then hashed each written record in a second full pass on the main
 * thread. Here each chunk is hashed right after it was updated, while it is
 * still in cache, by the thread that updated it; chunk CRCs are combined in
 * order (tm_crc32c_combine), as adam.c does for Adam.
 *
 * Arithmetic follows the vectorised body of torch's fused CPU kernels
 * (aten/src/ATen/native/cpu/FusedSGDKernel.cpp, FusedAdagradKernel.cpp, as
 * torch 2.13's build computes them: its compiler contracts a multiply feeding
 * an add into one FMA), per element, in float, coefficients rounded to float:
 *
 *   SGD:     g = maximize ? -grad : grad
 *            g = fma(p, wd, g)                           (wd != 0)
 *            b = first ? g : fma(1-dampening, g, b * momentum)   (momentum != 0)
 *            g = nesterov ? fma(b, momentum, g) : b
 *            p = fma(g, -lr, p)
 *   Adagrad: g = maximize ? -grad : grad
 *            g = fma(p, wd, g)                           (wd != 0)
 *            s = fma(g, g, s)
 *            p = p - (clr * g) / (sqrt(s) + eps)
 *
 * torch's scalar tail loop (the last n % vector-width elements of each tensor)
 * is compiled differently; the Python side runs torch's own kernel on those.
 * Every operation is correctly rounded, the file is built with
 * -ffp-contract=off and calls fmaf() exactly where an FMA is meant, so the
 * compiler's vectorisation of these loops (target clones below) cannot change
 * a result. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "tiermem_native.h"

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#define TM_RULES_CHUNK (16 * 1024)      /* elements updated then hashed at once */
#define TM_RULES_PAR_MIN (256 * 1024)   /* below this, no threads */
#define TM_RULES_MAX_THREADS 64

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TM_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define TM_CLONES
#endif

typedef struct rules_job {
    int kind;  /* 0 = SGD, 1 = Adagrad */
    float *p, *s;
    const float *g;
    float lr, wd, mom, damp1, clr, eps;
    int nesterov, maximize, first;
    int crc_mask;  /* 1: state, 2: params */
    int64_t begin, end;
    uint32_t crc_s, crc_p;
} rules_job;

TM_CLONES
static void sgd_run(const rules_job *j, int64_t a, int64_t b)
{
    float *restrict p = j->p, *restrict m = j->s;
    const float *restrict g = j->g;
    const float lr = j->lr, wd = j->wd, mom = j->mom, d1 = j->damp1;
    for (int64_t i = a; i < b; i++) {
        float x = j->maximize ? -g[i] : g[i];
        if (wd != 0.0f)
            x = fmaf(p[i], wd, x);
        if (m) {
            float buf = j->first ? x : fmaf(d1, x, m[i] * mom);
            m[i] = buf;
            x = j->nesterov ? fmaf(buf, mom, x) : buf;
        }
        p[i] = fmaf(x, lr, p[i]);  /* lr holds -lr */
    }
}

TM_CLONES
static void adagrad_run(const rules_job *j, int64_t a, int64_t b)
{
    float *restrict p = j->p, *restrict s = j->s;
    const float *restrict g = j->g;
    const float wd = j->wd, clr = j->clr, eps = j->eps;
    for (int64_t i = a; i < b; i++) {
        float x = j->maximize ? -g[i] : g[i];
        if (wd != 0.0f)
            x = fmaf(p[i], wd, x);
        float sum = fmaf(x, x, s[i]);
        s[i] = sum;
        p[i] = p[i] - (clr * x) / (sqrtf(sum) + eps);
    }
}

static void *rules_work(void *arg)
{
    rules_job *j = arg;
    uint32_t cs = 0, cp = 0;
    for (int64_t a = j->begin; a < j->end; a += TM_RULES_CHUNK) {
        int64_t b = a + TM_RULES_CHUNK < j->end ? a + TM_RULES_CHUNK : j->end;
        if (j->kind == 0)
            sgd_run(j, a, b);
        else
            adagrad_run(j, a, b);
        size_t len = (size_t)(b - a) * sizeof(float);
        if ((j->crc_mask & 1) && j->s)
            cs = tm_crc32c(cs, j->s + a, len);
        if (j->crc_mask & 2)
            cp = tm_crc32c(cp, j->p + a, len);
    }
    j->crc_s = cs;
    j->crc_p = cp;
    return NULL;
}

static int run_split(const rules_job *tmpl, int64_t n, int nthreads, uint32_t *crcs)
{
    if (nthreads < 1)
        nthreads = 1;
    if (nthreads > TM_RULES_MAX_THREADS)
        nthreads = TM_RULES_MAX_THREADS;
    if (n < TM_RULES_PAR_MIN)
        nthreads = 1;
    rules_job jobs[TM_RULES_MAX_THREADS];
    pthread_t tid[TM_RULES_MAX_THREADS];
    int started[TM_RULES_MAX_THREADS] = {0};
    /* pieces are whole chunks, so the split never changes which elements go together */
    int64_t chunks = (n + TM_RULES_CHUNK - 1) / TM_RULES_CHUNK;
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = *tmpl;
        jobs[t].begin = chunks * t / nthreads * TM_RULES_CHUNK;
        int64_t e = chunks * (t + 1) / nthreads * TM_RULES_CHUNK;
        jobs[t].end = e < n ? e : n;
        if (jobs[t].begin > n)
            jobs[t].begin = n;
    }
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&tid[t], NULL, rules_work, &jobs[t]) == 0;
    rules_work(&jobs[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            rules_work(&jobs[t]);  /* no thread: do its piece here */
    }
    if (crcs) {
        uint32_t cs = 0, cp = 0;
        for (int t = 0; t < nthreads; t++) {
            uint64_t len = (uint64_t)(jobs[t].end - jobs[t].begin) * sizeof(float);
            cs = tm_crc32c_combine(cs, jobs[t].crc_s, len);
            cp = tm_crc32c_combine(cp, jobs[t].crc_p, len);
        }
        crcs[0] = cs;
        crcs[1] = cp;
    }
    return 0;
}

int tm_sgd_step(float *p, float *momentum_buffer, const float *grad, int64_t n, double lr,
                double momentum, double dampening, double weight_decay, int nesterov,
                int maximize, int first, int nthreads, int crc_mask, uint32_t *crcs)
{
    if (n < 0 || !p || !grad || (momentum != 0.0) != (momentum_buffer != NULL) ||
        crc_mask < 0 || crc_mask > 3 || (crc_mask && !crcs))
        return -EINVAL;
    rules_job j = {0};
    j.kind = 0;
    j.p = p;
    j.s = momentum_buffer;
    j.g = grad;
    j.lr = (float)-lr;
    j.wd = (float)weight_decay;
    j.mom = (float)momentum;
    j.damp1 = (float)(1.0 - dampening);
    j.nesterov = nesterov;
    j.maximize = maximize;
    j.first = first;
    j.crc_mask = crc_mask;
    return run_split(&j, n, nthreads, crc_mask ? crcs : NULL);
}

int tm_adagrad_step(float *p, float *state_sum, const float *grad, int64_t n, double lr,
                    double lr_decay, double weight_decay, double eps, double step,
                    int maximize, int nthreads, int crc_mask, uint32_t *crcs)
{
    if (n < 0 || !p || !state_sum || !grad || step < 1 || crc_mask < 0 || crc_mask > 3 ||
        (crc_mask && !crcs))
        return -EINVAL;
    rules_job j = {0};
    j.kind = 1;
    j.p = p;
    j.s = state_sum;
    j.g = grad;
    j.wd = (float)weight_decay;
    /* torch: clr = lr / (1 + (step - 1) * lr_decay) in double, rounded once */
    j.clr = (float)(lr / (1.0 + (step - 1.0) * lr_decay));
    j.eps = (float)eps;
    j.maximize = maximize;
    j.crc_mask = crc_mask;
    return run_split(&j, n, nthreads, crc_mask ? crcs : NULL);
}
