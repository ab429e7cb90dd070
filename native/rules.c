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
 * Three paths (AVX-512, AVX2+FMA, portable C, picked at run time) give the
 * same bits: every operation is correctly rounded, the file is built with
 * -ffp-contract=off, and the scalar code calls fmaf() exactly where the SIMD
 * code has an FMA. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"
#include "tiermem_native.h"

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#define TM_RULES_CHUNK (16 * 1024)      /* elements updated then hashed at once */
#define TM_RULES_PAR_MIN (256 * 1024)   /* below this, no threads */
#define TM_RULES_MAX_THREADS 64

#if defined(__x86_64__) || defined(__i386__)
#define TM_X86 1
#include <immintrin.h>
#define TGT_AVX2 __attribute__((target("avx2,fma")))
#define TGT_AVX512 __attribute__((target("avx512f,fma")))
#else
#define TM_X86 0
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
    void (*fn)(const struct rules_job *, int64_t, int64_t);
} rules_job;

/* One element, portable: also the tail of the SIMD paths (same roundings). */
static inline void sgd_one(const rules_job *j, int64_t i)
{
    float x = j->maximize ? -j->g[i] : j->g[i];
    if (j->wd != 0.0f)
        x = fmaf(j->p[i], j->wd, x);
    if (j->s) {
        float buf = j->first ? x : fmaf(j->damp1, x, j->s[i] * j->mom);
        j->s[i] = buf;
        x = j->nesterov ? fmaf(buf, j->mom, x) : buf;
    }
    j->p[i] = fmaf(x, j->lr, j->p[i]);  /* lr holds -lr */
}

static inline void adagrad_one(const rules_job *j, int64_t i)
{
    float x = j->maximize ? -j->g[i] : j->g[i];
    if (j->wd != 0.0f)
        x = fmaf(j->p[i], j->wd, x);
    float sum = fmaf(x, x, j->s[i]);
    j->s[i] = sum;
    j->p[i] = j->p[i] - (j->clr * x) / (sqrtf(sum) + j->eps);
}

static void sgd_scalar(const rules_job *j, int64_t a, int64_t b)
{
    for (int64_t i = a; i < b; i++)
        sgd_one(j, i);
}

static void adagrad_scalar(const rules_job *j, int64_t a, int64_t b)
{
    for (int64_t i = a; i < b; i++)
        adagrad_one(j, i);
}

#if TM_X86
static TGT_AVX512 inline __m512 tm_xor512(__m512 a, __m512 b)
{
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

/* The SIMD bodies, written once per width: V is the vector type, W its lanes. */
#define SIMD_BODIES(SFX, TGT, V, W, LOAD, STORE, SET1, MUL, ADD, SUB, DIV, SQRT, FMA, XOR)  \
static TGT void sgd_##SFX(const rules_job *j, int64_t a, int64_t b)                   \
{                                                                                     \
    const V lr = SET1(j->lr), wd = SET1(j->wd), mom = SET1(j->mom), d1 = SET1(j->damp1); \
    const V sign = SET1(j->maximize ? -0.0f : 0.0f);                                  \
    const int use_wd = j->wd != 0.0f, first = j->first, nest = j->nesterov;           \
    float *p = j->p, *m = j->s;                                                       \
    const float *g = j->g;                                                            \
    int64_t i = a;                                                                    \
    for (; i + W <= b; i += W) {                                                      \
        V pv = LOAD(p + i);                                                           \
        V x = XOR(LOAD(g + i), sign);                                                 \
        if (use_wd)                                                                   \
            x = FMA(pv, wd, x);                                                       \
        if (m) {                                                                      \
            V buf = first ? x : FMA(d1, x, MUL(LOAD(m + i), mom));                    \
            STORE(m + i, buf);                                                        \
            x = nest ? FMA(buf, mom, x) : buf;                                        \
        }                                                                             \
        STORE(p + i, FMA(x, lr, pv));                                                 \
    }                                                                                 \
    sgd_scalar(j, i, b);                                                              \
}                                                                                     \
static TGT void adagrad_##SFX(const rules_job *j, int64_t a, int64_t b)               \
{                                                                                     \
    const V wd = SET1(j->wd), clr = SET1(j->clr), eps = SET1(j->eps);                \
    const V sign = SET1(j->maximize ? -0.0f : 0.0f);                                  \
    const int use_wd = j->wd != 0.0f;                                                 \
    float *p = j->p, *s = j->s;                                                       \
    const float *g = j->g;                                                            \
    int64_t i = a;                                                                    \
    for (; i + W <= b; i += W) {                                                      \
        V pv = LOAD(p + i);                                                           \
        V x = XOR(LOAD(g + i), sign);                                                 \
        if (use_wd)                                                                   \
            x = FMA(pv, wd, x);                                                       \
        V sum = FMA(x, x, LOAD(s + i));                                               \
        STORE(s + i, sum);                                                            \
        STORE(p + i, SUB(pv, DIV(MUL(clr, x), ADD(SQRT(sum), eps))));                 \
    }                                                                                 \
    adagrad_scalar(j, i, b);                                                          \
}

SIMD_BODIES(avx2, TGT_AVX2, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,
            _mm256_mul_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_div_ps, _mm256_sqrt_ps,
            _mm256_fmadd_ps, _mm256_xor_ps)
SIMD_BODIES(avx512, TGT_AVX512, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps,
            _mm512_set1_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_sub_ps, _mm512_div_ps,
            _mm512_sqrt_ps, _mm512_fmadd_ps, tm_xor512)
#endif

typedef void (*rules_fn)(const rules_job *, int64_t, int64_t);

/* -1: the best path this CPU has; 0 scalar, 1 AVX2+FMA, 2 AVX-512 (tests force each). */
static int forced_isa = -1;

static int isa_supported(int isa)
{
    if (isa == 0)
        return 1;
#if TM_X86
    __builtin_cpu_init();
    if (isa == 1)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == 2)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#endif
    return 0;
}

int tm_rules_set_isa(int isa)
{
    if (isa != -1 && !isa_supported(isa))
        return 0;
    forced_isa = isa;
    return 1;
}

static rules_fn pick(int kind)
{
    int isa = forced_isa;
    if (isa < 0)
        isa = isa_supported(2) ? 2 : isa_supported(1) ? 1 : 0;
#if TM_X86
    if (isa == 2)
        return kind == 0 ? sgd_avx512 : adagrad_avx512;
    if (isa == 1)
        return kind == 0 ? sgd_avx2 : adagrad_avx2;
#endif
    return kind == 0 ? sgd_scalar : adagrad_scalar;
}

static void *rules_work(void *arg)
{
    rules_job *j = arg;
    uint32_t cs = 0, cp = 0;
    for (int64_t a = j->begin; a < j->end; a += TM_RULES_CHUNK) {
        int64_t b = a + TM_RULES_CHUNK < j->end ? a + TM_RULES_CHUNK : j->end;
        j->fn(j, a, b);
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
    tm_parallel_pieces(rules_work, jobs, sizeof(rules_job), nthreads);
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
    j.fn = pick(j.kind);
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
    j.fn = pick(j.kind);
    return run_split(&j, n, nthreads, crc_mask ? crcs : NULL);
}
