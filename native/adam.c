/* The Adam/AdamW update in one fused pass over fp32 master weights and moments.
 *
 * tm_adam_step reads the gradient (fp32, bf16 or fp16, upcast in registers),
 * updates the fp32 parameters, exp_avg, exp_avg_sq (and max_exp_avg_sq with
 * amsgrad) in place, and optionally writes a bf16 or fp16 copy of the updated
 * parameters (round to nearest even) in the same pass.
 *
 * Arithmetic follows the vectorised body of torch's fused CPU Adam
 * (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, as torch 2.13's AVX-512 build
 * computes it): coefficients are formed in double and rounded to float once,
 * then per element, in float:
 *
 *   g  = maximize ? -grad : grad
 *   Adam:  g = fma(p, wd, g)          AdamW: p = p * (1 - lr*wd)   (when wd != 0)
 *   m  = |1-beta1| < 0.5 ? fma(1-beta1, g - m, m) : fma((1-beta1) - 1, g - m, g)
 *   v  = fma((1-beta2) * g, g, v * beta2)
 *   vmax = max(vmax, v)                (amsgrad; the denominator then uses vmax)
 *   p  = p + ((-lr/bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)
 *
 * Three paths, picked at run time: AVX-512 (F, BW, VL), AVX2 + FMA + F16C, and
 * portable scalar C. Every operation above is correctly rounded (IEEE add, mul,
 * div, sqrt, fused multiply-add), the file is built with -ffp-contract=off,
 * and the scalar path calls fmaf() exactly where the SIMD paths use an FMA
 * instruction, so all three give bitwise the same result for every element.
 *
 * Threads: n is split across a small persistent pool of pthreads (the caller
 * works too); below TM_ADAM_PAR_MIN elements everything runs on the calling
 * thread. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define TM_X86 1
#include <immintrin.h>
#else
#define TM_X86 0
#endif

#include "tiermem_native.h"

/* Contraction would change rounding; the build passes -ffp-contract=off, and
 * clang also honours the standard pragma. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

enum { ISA_AUTO = -1, ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define TM_ADAM_PAR_MIN (256 * 1024)   /* below this, no threads */
#define TM_ADAM_PAR_UNIT (128 * 1024)  /* at least this many elements per thread */
#define TM_ADAM_CHUNK (64 * 1024)      /* threads take chunks of this many elements */
#define TM_ADAM_MAX_THREADS 256

typedef struct adam_job {
    float *p, *m, *v, *vmax;
    const void *g;
    void *out;
    int g_dtype, out_dtype;   /* out_dtype only meaningful when out != NULL */
    int amsgrad, maximize;
    int wd_mode;              /* 0 none, 1 L2 (Adam), 2 decoupled (AdamW) */
    int small;                /* |1 - beta1| < 0.5: lerp from m, else from g */
    int nt_out;               /* streaming stores for out (AVX-512 path only) */
    float wd, decay, c1, c1m1, b2, c2, bc2s, eps, nss;
} adam_job;

/* -- conversions (scalar) ----------------------------------------------------- */

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* Exact; NaNs come out quiet with the payload kept, as VCVTPH2PS does. */
static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (e == 0) {
        if (mant == 0)
            return f32_from_bits(sign);
        uint32_t e32 = 113;  /* normalise the subnormal */
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e32--;
        }
        return f32_from_bits(sign | (e32 << 23) | ((mant & 0x3FFu) << 13));
    }
    if (e == 31)
        return f32_from_bits(sign | 0x7F800000u | (mant ? 0x00400000u | (mant << 13) : 0));
    return f32_from_bits(sign | ((e + 112) << 23) | (mant << 13));
}

/* Round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Round to nearest even with overflow to infinity and subnormal results, as
 * VCVTPS2PH with imm 0 does; NaNs stay NaN, quieted, top payload bits kept. */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return sign | 0x7E00u | (uint16_t)((a >> 13) & 0x3FFu);
    if (a >= 0x47800000u)            /* >= 65536 (and inf): infinity */
        return sign | 0x7C00u;
    if (a >= 0x38800000u) {          /* normal half (>= 2^-14), may round up to inf */
        uint32_t r = a + 0xC8000FFFu + ((a >> 13) & 1u);  /* rebias by -112, round */
        return sign | (uint16_t)(r >> 13);
    }
    uint32_t e = a >> 23;
    if (e < 102)                     /* < 2^-25: rounds to zero */
        return sign;
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e;        /* 14..24 */
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return sign | (uint16_t)q;
}

static inline float load_g(const adam_job *j, int64_t i)
{
    if (j->g_dtype == DT_F32)
        return ((const float *)j->g)[i];
    uint16_t h = ((const uint16_t *)j->g)[i];
    return j->g_dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* torch's maximum(): NaN if either is NaN (all bits set), else the larger, the
 * second on ties (MAXPS semantics). */
static inline float max_nan(float a, float b)
{
    if (a != a || b != b)
        return f32_from_bits(0xFFFFFFFFu);
    return a > b ? a : b;
}

/* -- scalar path ---------------------------------------------------------------- */

static void adam_scalar(const adam_job *jin, int64_t begin, int64_t end)
{
    adam_job c = *jin;  /* fields in registers, not reloaded after each store */
    const adam_job *j = &c;
    for (int64_t i = begin; i < end; i++) {
        float g = load_g(j, i);
        float p = j->p[i], m = j->m[i], v = j->v[i];
        if (j->maximize)
            g = -g;
        if (j->wd_mode == 1)
            g = fmaf(p, j->wd, g);
        else if (j->wd_mode == 2)
            p = p * j->decay;
        float d = g - m;
        m = j->small ? fmaf(j->c1, d, m) : fmaf(j->c1m1, d, g);
        float cg = j->c2 * g;
        float vb = v * j->b2;
        v = fmaf(cg, g, vb);
        float vv = v;
        if (j->amsgrad) {
            vv = max_nan(j->vmax[i], v);
            j->vmax[i] = vv;
        }
        float denom = sqrtf(vv) / j->bc2s + j->eps;
        float upd = (j->nss * m) / denom;
        p = p + upd;
        j->p[i] = p;
        j->m[i] = m;
        j->v[i] = v;
        if (j->out) {
            uint16_t *o = (uint16_t *)j->out;
            o[i] = j->out_dtype == DT_BF16 ? f32_to_bf16(p) : f32_to_f16(p);
        }
    }
}

#if TM_X86

/* -- AVX2 + FMA + F16C path (8 lanes; the ragged tail goes through a stack copy) - */

#define TGT_AVX2 __attribute__((target("avx2,fma,f16c")))

static inline TGT_AVX2 __attribute__((always_inline)) void
adam8(const adam_job *j, float *pp, float *mp, float *vp, float *vmp, const void *gp,
      void *op)
{
    __m256 g;
    if (j->g_dtype == DT_F32) {
        g = _mm256_loadu_ps((const float *)gp);
    } else {
        __m128i h = _mm_loadu_si128((const __m128i *)gp);
        if (j->g_dtype == DT_BF16)
            g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        else
            g = _mm256_cvtph_ps(h);
    }
    __m256 p = _mm256_loadu_ps(pp), m = _mm256_loadu_ps(mp), v = _mm256_loadu_ps(vp);
    if (j->maximize)
        g = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
    if (j->wd_mode == 1)
        g = _mm256_fmadd_ps(p, _mm256_set1_ps(j->wd), g);
    else if (j->wd_mode == 2)
        p = _mm256_mul_ps(p, _mm256_set1_ps(j->decay));
    __m256 d = _mm256_sub_ps(g, m);
    m = j->small ? _mm256_fmadd_ps(_mm256_set1_ps(j->c1), d, m)
                 : _mm256_fmadd_ps(_mm256_set1_ps(j->c1m1), d, g);
    __m256 cg = _mm256_mul_ps(_mm256_set1_ps(j->c2), g);
    __m256 vb = _mm256_mul_ps(v, _mm256_set1_ps(j->b2));
    v = _mm256_fmadd_ps(cg, g, vb);
    __m256 vv = v;
    if (j->amsgrad) {
        __m256 a = _mm256_loadu_ps(vmp);
        vv = _mm256_or_ps(_mm256_max_ps(a, v), _mm256_cmp_ps(a, v, _CMP_UNORD_Q));
        _mm256_storeu_ps(vmp, vv);
    }
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), _mm256_set1_ps(j->bc2s)),
                                 _mm256_set1_ps(j->eps));
    __m256 upd = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(j->nss), m), denom);
    p = _mm256_add_ps(p, upd);
    _mm256_storeu_ps(pp, p);
    _mm256_storeu_ps(mp, m);
    _mm256_storeu_ps(vp, v);
    if (op) {
        __m128i h;
        if (j->out_dtype == DT_BF16) {
            __m256i u = _mm256_castps_si256(p);
            __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
            __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
            r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
            h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        } else {
            h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
        }
        _mm_storeu_si128((__m128i *)op, h);
    }
}

static inline TGT_AVX2 __attribute__((always_inline)) void
loop256(const adam_job *jin, int64_t begin, int64_t end, int gdt, int odt)
{
    adam_job c = *jin;  /* see loop512 */
    adam_job *j = &c;
    j->g_dtype = gdt;
    j->out_dtype = odt;
    if (odt < 0)
        j->out = NULL;
    size_t gsz = j->g_dtype == DT_F32 ? 4 : 2;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        adam8(j, j->p + i, j->m + i, j->v + i, j->amsgrad ? j->vmax + i : NULL,
              (const char *)j->g + i * gsz, j->out ? (char *)j->out + i * 2 : NULL);
    int64_t rem = end - i;
    if (rem > 0) {
        float p[8] = {0}, m[8] = {0}, v[8] = {0}, vm[8] = {0}, g[8] = {0};
        uint16_t o[8];
        size_t fb = (size_t)rem * 4;
        memcpy(p, j->p + i, fb);
        memcpy(m, j->m + i, fb);
        memcpy(v, j->v + i, fb);
        if (j->amsgrad)
            memcpy(vm, j->vmax + i, fb);
        memcpy(g, (const char *)j->g + i * gsz, (size_t)rem * gsz);
        adam8(j, p, m, v, vm, g, j->out ? o : NULL);
        memcpy(j->p + i, p, fb);
        memcpy(j->m + i, m, fb);
        memcpy(j->v + i, v, fb);
        if (j->amsgrad)
            memcpy(j->vmax + i, vm, fb);
        if (j->out)
            memcpy((char *)j->out + i * 2, o, (size_t)rem * 2);
    }
}

static TGT_AVX2 void adam_avx2(const adam_job *j, int64_t begin, int64_t end)
{
    int odt = j->out ? j->out_dtype : -1;
#define TM_CASE(G, O) \
    if (j->g_dtype == G && odt == O) { loop256(j, begin, end, G, O); return; }
    TM_CASE(DT_F32, -1) TM_CASE(DT_F32, DT_BF16) TM_CASE(DT_F32, DT_F16)
    TM_CASE(DT_BF16, -1) TM_CASE(DT_BF16, DT_BF16) TM_CASE(DT_BF16, DT_F16)
    TM_CASE(DT_F16, -1) TM_CASE(DT_F16, DT_BF16) TM_CASE(DT_F16, DT_F16)
#undef TM_CASE
}

/* -- AVX-512 path (16 lanes; the ragged tail uses masked loads and stores) ------- */

#define TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

static inline TGT_AVX512 __attribute__((always_inline)) void
adam16(const adam_job *j, int64_t i, __mmask16 k, int nt)
{
    __m512 g;
    if (j->g_dtype == DT_F32) {
        g = _mm512_maskz_loadu_ps(k, (const float *)j->g + i);
    } else {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)j->g + i);
        if (j->g_dtype == DT_BF16)
            g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        else
            g = _mm512_cvtph_ps(h);
    }
    __m512 p = _mm512_maskz_loadu_ps(k, j->p + i);
    __m512 m = _mm512_maskz_loadu_ps(k, j->m + i);
    __m512 v = _mm512_maskz_loadu_ps(k, j->v + i);
    if (j->maximize)
        g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g),
                                                 _mm512_set1_epi32((int)0x80000000u)));
    if (j->wd_mode == 1)
        g = _mm512_fmadd_ps(p, _mm512_set1_ps(j->wd), g);
    else if (j->wd_mode == 2)
        p = _mm512_mul_ps(p, _mm512_set1_ps(j->decay));
    __m512 d = _mm512_sub_ps(g, m);
    m = j->small ? _mm512_fmadd_ps(_mm512_set1_ps(j->c1), d, m)
                 : _mm512_fmadd_ps(_mm512_set1_ps(j->c1m1), d, g);
    __m512 cg = _mm512_mul_ps(_mm512_set1_ps(j->c2), g);
    __m512 vb = _mm512_mul_ps(v, _mm512_set1_ps(j->b2));
    v = _mm512_fmadd_ps(cg, g, vb);
    __m512 vv = v;
    if (j->amsgrad) {
        __m512 a = _mm512_maskz_loadu_ps(k, j->vmax + i);
        __mmask16 un = _mm512_cmp_ps_mask(a, v, _CMP_UNORD_Q);
        vv = _mm512_mask_mov_ps(_mm512_max_ps(a, v), un,
                                _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
        _mm512_mask_storeu_ps(j->vmax + i, k, vv);
    }
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), _mm512_set1_ps(j->bc2s)),
                                 _mm512_set1_ps(j->eps));
    __m512 upd = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(j->nss), m), denom);
    p = _mm512_add_ps(p, upd);
    _mm512_mask_storeu_ps(j->p + i, k, p);
    _mm512_mask_storeu_ps(j->m + i, k, m);
    _mm512_mask_storeu_ps(j->v + i, k, v);
    if (j->out) {
        __m256i h;
        if (j->out_dtype == DT_BF16) {
            __m512i u = _mm512_castps_si512(p);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
            r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q),
                                      _mm512_set1_epi32(0x7FC0));
            h = _mm512_cvtepi32_epi16(r);
        } else {
            h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        if (nt)
            _mm256_stream_si256((__m256i *)((uint16_t *)j->out + i), h);
        else
            _mm256_mask_storeu_epi16((uint16_t *)j->out + i, k, h);
    }
}

/* The job is copied to a local whose address never escapes, so its fields live
 * in registers rather than being reloaded after every store through a float
 * pointer; gdt/odt are literal constants at each call site below. */
static inline TGT_AVX512 __attribute__((always_inline)) void
loop512(const adam_job *jin, int64_t begin, int64_t end, int gdt, int odt)
{
    adam_job c = *jin;
    adam_job *j = &c;
    j->g_dtype = gdt;
    j->out_dtype = odt;
    if (odt < 0)
        j->out = NULL;
    int64_t i = begin;
    int nt = 0;
    if (odt >= 0 && j->nt_out && !((uintptr_t)j->out & 1u)) {
        /* Streaming stores need 32-byte alignment: plain (masked) stores up to
         * the first aligned element, then stream. */
        uintptr_t addr = (uintptr_t)((uint16_t *)j->out + i);
        int64_t a = (int64_t)(((32u - (addr & 31u)) & 31u) / 2u);
        if (a > 0 && i + a <= end) {
            adam16(j, i, (__mmask16)((1u << a) - 1u), 0);
            i += a;
        }
        nt = ((uintptr_t)((uint16_t *)j->out + i) & 31u) == 0;
    }
    if (nt) {
        for (; i + 16 <= end; i += 16)
            adam16(j, i, (__mmask16)0xFFFF, 1);
        _mm_sfence();
    } else {
        for (; i + 16 <= end; i += 16)
            adam16(j, i, (__mmask16)0xFFFF, 0);
    }
    if (i < end)
        adam16(j, i, (__mmask16)((1u << (end - i)) - 1u), 0);
}

static TGT_AVX512 void adam_avx512(const adam_job *j, int64_t begin, int64_t end)
{
    int odt = j->out ? j->out_dtype : -1;
#define TM_CASE(G, O) \
    if (j->g_dtype == G && odt == O) { loop512(j, begin, end, G, O); return; }
    TM_CASE(DT_F32, -1) TM_CASE(DT_F32, DT_BF16) TM_CASE(DT_F32, DT_F16)
    TM_CASE(DT_BF16, -1) TM_CASE(DT_BF16, DT_BF16) TM_CASE(DT_BF16, DT_F16)
    TM_CASE(DT_F16, -1) TM_CASE(DT_F16, DT_BF16) TM_CASE(DT_F16, DT_F16)
#undef TM_CASE
}

#endif /* TM_X86 */

/* -- ISA selection ------------------------------------------------------------- */

int tm_adam_isa_supported(int isa)
{
    if (isa == ISA_SCALAR)
        return 1;
#if TM_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
#endif
    return 0;
}

static int best_isa(void)
{
    static int best = ISA_AUTO;  /* racing first callers compute the same value */
    if (best == ISA_AUTO)
        best = tm_adam_isa_supported(ISA_AVX512) ? ISA_AVX512
             : tm_adam_isa_supported(ISA_AVX2)   ? ISA_AVX2
                                                 : ISA_SCALAR;
    return best;
}

static volatile int forced_isa = ISA_AUTO;

int tm_adam_set_isa(int isa)
{
    if (isa == ISA_AUTO) {
        forced_isa = ISA_AUTO;
        return 1;
    }
    if (isa < ISA_SCALAR || isa > ISA_AVX512 || !tm_adam_isa_supported(isa))
        return 0;
    forced_isa = isa;
    return 1;
}

int tm_adam_get_isa(void)
{
    int isa = forced_isa;
    return isa == ISA_AUTO ? best_isa() : isa;
}

typedef void (*adam_fn)(const adam_job *, int64_t, int64_t);

static adam_fn fn_for(int isa)
{
#if TM_X86
    if (isa == ISA_AVX512)
        return adam_avx512;
    if (isa == ISA_AVX2)
        return adam_avx2;
#endif
    (void)isa;
    return adam_scalar;
}

/* -- thread pool ------------------------------------------------------------------ */

typedef struct {
    const adam_job *job;
    adam_fn fn;
    int64_t n;
    int64_t next;  /* next chunk to hand out (atomic) */
} adam_task;

static struct {
    pthread_mutex_t call;   /* one caller at a time */
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    pthread_t threads[TM_ADAM_MAX_THREADS];
    uint64_t start_gen[TM_ADAM_MAX_THREADS + 1];  /* gen when each worker was made */
    int nworkers;
    uint64_t gen;
    int pending;
    int parts;        /* threads on the current task, caller included */
    adam_task *task;  /* the caller's; only its parts - 1 workers may touch it */
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
          .work = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* Take chunks until none are left: a thread slowed by other work on its core
 * simply takes fewer of them. */
static void run_chunks(adam_task *t)
{
    int64_t nchunks = (t->n + TM_ADAM_CHUNK - 1) / TM_ADAM_CHUNK;
    for (;;) {
        int64_t k = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (k >= nchunks)
            return;
        int64_t b = k * TM_ADAM_CHUNK;
        int64_t e = b + TM_ADAM_CHUNK < t->n ? b + TM_ADAM_CHUNK : t->n;
        t->fn(t->job, b, e);
    }
}

static void *worker(void *arg)
{
    int idx = (int)(intptr_t)arg;  /* parts 1..nworkers; the caller takes part 0 */
    uint64_t seen;
    pthread_mutex_lock(&pool.mu);
    seen = pool.start_gen[idx];  /* a task posted before we got the lock is ours too */
    for (;;) {
        while (pool.gen == seen)
            pthread_cond_wait(&pool.work, &pool.mu);
        seen = pool.gen;
        if (idx >= pool.parts)
            continue;
        adam_task *t = pool.task;
        pthread_mutex_unlock(&pool.mu);
        run_chunks(t);
        pthread_mutex_lock(&pool.mu);
        if (--pool.pending == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* After fork only the forking thread exists in the child: forget the workers. */
static void atfork_child(void)
{
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.nworkers = 0;
    pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

/* Under pool.mu: grow to `want` workers; returns how many there are. */
static int grow_pool(int want)
{
    pthread_once(&atfork_once, register_atfork);
    if (want > TM_ADAM_MAX_THREADS)
        want = TM_ADAM_MAX_THREADS;
    while (pool.nworkers < want) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        pool.start_gen[pool.nworkers + 1] = pool.gen;
        int rc = pthread_create(&pool.threads[pool.nworkers], &attr, worker,
                                (void *)(intptr_t)(pool.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool.nworkers++;
    }
    return pool.nworkers;
}

static void run_threaded(const adam_job *j, adam_fn fn, int64_t n, int nthreads)
{
    int parts = 1;
    if (n >= TM_ADAM_PAR_MIN && nthreads > 1) {
        int64_t most = n / TM_ADAM_PAR_UNIT;
        parts = nthreads < most ? nthreads : (int)most;
        if (parts > TM_ADAM_MAX_THREADS + 1)
            parts = TM_ADAM_MAX_THREADS + 1;
    }
    if (parts <= 1) {
        fn(j, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.mu);
    int workers = grow_pool(parts - 1);
    if (parts > workers + 1)
        parts = workers + 1;
    adam_task t = {j, fn, n, 0};
    if (parts > 1) {
        pool.task = &t;
        pool.parts = parts;
        pool.pending = parts - 1;
        pool.gen++;
        pthread_cond_broadcast(&pool.work);
    }
    pthread_mutex_unlock(&pool.mu);
    run_chunks(&t);
    pthread_mutex_lock(&pool.mu);
    while (pool.pending > 0)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.call);
}

/* -- entry point ------------------------------------------------------------------ */

int tm_adam_step(float *p, float *exp_avg, float *exp_avg_sq, float *max_exp_avg_sq,
                 const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 double step, int amsgrad, int maximize, int decoupled, int nthreads)
{
    if (n < 0 || grad_dtype < DT_F32 || grad_dtype > DT_F16)
        return -EINVAL;
    if (out && out_dtype != DT_BF16 && out_dtype != DT_F16)
        return -EINVAL;
    if (n == 0)
        return 0;
    if (!p || !exp_avg || !exp_avg_sq || !grad || (amsgrad && !max_exp_avg_sq))
        return -EINVAL;

    /* Coefficients in double, rounded to float once, as torch forms them. */
    double bc1 = 1.0 - pow(beta1, step);
    double bc2 = 1.0 - pow(beta2, step);
    double step_size = lr / bc1;
    adam_job j = {
        .p = p, .m = exp_avg, .v = exp_avg_sq, .vmax = amsgrad ? max_exp_avg_sq : NULL,
        .g = grad, .out = out, .g_dtype = grad_dtype, .out_dtype = out_dtype,
        .amsgrad = !!amsgrad, .maximize = !!maximize,
        .wd_mode = weight_decay != 0.0 ? (decoupled ? 2 : 1) : 0,
        .wd = (float)weight_decay, .decay = (float)(1.0 - lr * weight_decay),
        .c1 = (float)(1.0 - beta1), .b2 = (float)beta2, .c2 = (float)(1.0 - beta2),
        .bc2s = (float)sqrt(bc2), .eps = (float)eps, .nss = (float)(-step_size),
    };
    j.c1m1 = j.c1 - 1.0f;
    j.small = fabsf(j.c1) < 0.5f;
    /* Stream the low-precision copy past the caches when it is far bigger than
     * them: it is not read again in this step. */
    j.nt_out = out != NULL && n >= (int64_t)8 * 1024 * 1024;
    run_threaded(&j, fn_for(tm_adam_get_isa()), n, nthreads);
    return 0;
}
