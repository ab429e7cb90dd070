/* The Adam/AdamW update in one fused pass over fp32 master weights and moments.
 *
 * tm_adam_step reads the gradient (fp32, bf16 or fp16, upcast in registers),
 * updates the fp32 parameters, exp_avg, exp_avg_sq (and max_exp_avg_sq with
 * amsgrad) in place, and optionally writes a bf16 or fp16 copy of the updated
 * parameters (round to nearest even) in the same pass.
 *
 * The moments may be stored in bf16 (state_mode 1 and 2): they are loaded into
 * fp32 registers, updated with exactly the arithmetic below, the parameter step
 * uses those fp32 values, and only the stores round them to bf16, to nearest
 * even (mode 1) or stochastically (mode 2). Stochastic rounding adds 16 random
 * bits below the bf16 mantissa and truncates: x rounds up with probability equal
 * to its distance from the bf16 value below, so the rounding is unbiased. The bits
 * come from a counter-based hash of (seed, element index), not from a generator
 * with state, so every path and every split of the work across threads draws
 * the same bits for the same element (see sr_bits).
 *
 * Arithmetic follows the vectorised body of torch's fused CPU Adam
 * (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, as torch 2.13's AVX-512 build
 * computes it); the scalar and AVX-512 paths here and in adam_lowbit.c share it
 * through numeric.h (tm_adam_coef_make, tm_moments*, tm_param_step*): coefficients
 * are formed in double and rounded to float once, then per element, in float:
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
 * Threads: n is cut into chunks that the threads take in turn (the caller works
 * too); below TM_ADAM_PAR_MIN elements everything runs on the calling thread.
 * Built with OpenMP (build_native.py probes for it), the threads are OpenMP's:
 * the libgomp torch's CPU wheel loads, so the pass runs on the team ATen's own
 * ops use, whose idle worker spins for a few ms after each parallel region (an
 * optimizer step right after backward finds it awake) instead of competing with
 * a second pool for the same cores (docs/dev/benchmarks.md). Otherwise, and in
 * a process forked after this library was loaded (libgomp's team does not
 * survive fork) or for a call from any thread but the main one (whose team ATen
 * uses), a small persistent pool of pthreads of our own. The chunks and so the
 * results are the same either way.
 *
 * Checksums (tm_adam_step_crc): the CRC32C of each output array the caller
 * asks for (crc_mask) is computed chunk by chunk right after that chunk was
 * updated, by the thread that updated it, while the chunk is still in its
 * cache; the chunk CRCs are combined in order once the threads joined. The
 * arithmetic paths are not touched: the CRCs only read what they stored. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "numeric.h"
#include "parallel.h"
#include "tiermem_native.h"

/* Contraction would change rounding; the build passes -ffp-contract=off, and
 * clang also honours the standard pragma. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

enum { ISA_AUTO = -1, ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { ST_F32 = 0, ST_BF16_RNE = 1, ST_BF16_SR = 2 };  /* how the moments are stored */

#define TM_ADAM_PAR_MIN (256 * 1024)   /* below this, no threads */
#define TM_ADAM_PAR_UNIT (128 * 1024)  /* at least this many elements per thread */
#define TM_ADAM_CHUNK (64 * 1024)      /* a pass that hashes takes chunks of this many */
/* Threads take chunks of up to this many elements (stream_chunk). With 64K-element
 * chunks handed out in turn to two threads the fp32 pass over 100M elements (25 tensors)
 * ran 1.06-1.08x torch's fused AdamW on this 2-vCPU Zen 5 VM when memory moved ~120 GB/s;
 * with 256K 1.00-1.01x, 1M 0.98-0.99x, 4M 1.00-1.02x (alternated in one process, 15
 * rounds each; docs/dev/benchmarks.md, twenty-second session). */
#define TM_ADAM_STREAM_CHUNK (1024 * 1024)
#define TM_ADAM_MAX_THREADS 256

typedef struct adam_job {
    float *p;
    void *m, *v, *vmax;       /* float, or uint16_t (bf16) when s_mode != ST_F32 */
    const void *g;
    void *out;
    int g_dtype, out_dtype;   /* out_dtype only meaningful when out != NULL */
    int s_mode;               /* ST_*: moment storage and rounding */
    uint32_t idx0;            /* stream index of element 0 (low 32 bits; ST_BF16_SR) */
    uint32_t k0, k1;          /* hash key for this job's 2^32-element window */
    int amsgrad;
    int nt_out;               /* streaming stores for out (AVX-512 path only) */
    int pf;                   /* software prefetch (tm_adam_get_prefetch) */
    /* Elements from this one on (relative to p) run torch's scalar-loop arithmetic
     * (numeric.h, torch_tail) on the scalar path; INT64_MAX: none. */
    int64_t tail_from;
    tm_adam_coef k;           /* the arithmetic's coefficients (numeric.h) */
} adam_job;

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
    int bf = j->s_mode != ST_F32;
    float *m32 = (float *)j->m, *v32 = (float *)j->v, *vm32 = (float *)j->vmax;
    uint16_t *m16 = (uint16_t *)j->m, *v16 = (uint16_t *)j->v, *vm16 = (uint16_t *)j->vmax;
    for (int64_t i = begin; i < end; i++) {
        float g = load_g(j, i);
        float p = j->p[i];
        float m = bf ? bf16_to_f32(m16[i]) : m32[i];
        float v = bf ? bf16_to_f32(v16[i]) : v32[i];
        tm_moments1(&j->k, &g, &p, &m, &v);
        float vv = v;
        if (j->amsgrad)
            vv = max_nan(bf ? bf16_to_f32(vm16[i]) : vm32[i], v);
        p = tm_param_step1(&j->k, p, m, vv);
        j->p[i] = p;
        if (j->s_mode == ST_F32) {
            m32[i] = m;
            v32[i] = v;
            if (j->amsgrad)
                vm32[i] = vv;
        } else if (j->s_mode == ST_BF16_RNE) {
            m16[i] = f32_to_bf16(m);
            v16[i] = f32_to_bf16(v);
            if (j->amsgrad)
                vm16[i] = f32_to_bf16(vv);
        } else {
            uint32_t r = sr_bits(j->idx0 + (uint32_t)i, j->k0, j->k1);
            m16[i] = f32_to_bf16_sr(m, r & 0xFFFFu);
            v16[i] = f32_to_bf16_sr(v, r >> 16);
            if (j->amsgrad)
                vm16[i] = f32_to_bf16_sr(vv, r >> 16);
        }
        if (j->out) {
            uint16_t *o = (uint16_t *)j->out;
            o[i] = j->out_dtype == DT_BF16 ? f32_to_bf16(p) : f32_to_f16(p);
        }
    }
}

#if TM_X86

/* -- AVX2 + FMA + F16C path (8 lanes; the ragged tail goes through a stack copy) - */

#define TGT_AVX2 TM_TGT_AVX2

/* Moments: 8 fp32, or 8 bf16 widened (exact). */
static inline TGT_AVX2 __attribute__((always_inline)) __m256
load8(const void *src, int sdt)
{
    if (sdt == ST_F32)
        return _mm256_loadu_ps((const float *)src);
    return bf16x8(_mm_loadu_si128((const __m128i *)src));
}

/* Store 8 moments as the job stores them; r: sr_bits lanes (ST_BF16_SR), `hi`
 * picks which 16 of them. */
static inline TGT_AVX2 __attribute__((always_inline)) void
store8(void *dst, __m256 x, int sdt, __m256i r, int hi)
{
    if (sdt == ST_F32) {
        _mm256_storeu_ps((float *)dst, x);
        return;
    }
    __m128i h;
    if (sdt == ST_BF16_RNE)
        h = bf16_rne8(x);
    else
        h = bf16_sr8(x, hi ? _mm256_srli_epi32(r, 16)
                           : _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)));
    _mm_storeu_si128((__m128i *)dst, h);
}

/* idx: stream index (low 32 bits) of the first of the 8 elements. */
static inline TGT_AVX2 __attribute__((always_inline)) void
adam8(const adam_job *j, float *pp, void *mp, void *vp, void *vmp, const void *gp, void *op,
      uint32_t idx)
{
    int sdt = j->s_mode;
    __m256 g;
    if (j->g_dtype == DT_F32) {
        g = _mm256_loadu_ps((const float *)gp);
    } else {
        __m128i h = _mm_loadu_si128((const __m128i *)gp);
        if (j->g_dtype == DT_BF16)
            g = bf16x8(h);
        else
            g = _mm256_cvtph_ps(h);
    }
    __m256 p = _mm256_loadu_ps(pp), m = load8(mp, sdt), v = load8(vp, sdt);
    tm_moments8(&j->k, &g, &p, &m, &v);
    __m256 vv = v;
    if (j->amsgrad) {
        __m256 a = load8(vmp, sdt);
        vv = _mm256_or_ps(_mm256_max_ps(a, v), _mm256_cmp_ps(a, v, _CMP_UNORD_Q));
    }
    p = tm_param_step8(&j->k, p, m, vv);
    _mm256_storeu_ps(pp, p);
    __m256i r = sdt == ST_BF16_SR ? sr_bits8(idx, j->k0, j->k1) : _mm256_setzero_si256();
    store8(mp, m, sdt, r, 0);
    store8(vp, v, sdt, r, 1);
    if (j->amsgrad)
        store8(vmp, vv, sdt, r, 1);
    if (op) {
        __m128i h = j->out_dtype == DT_BF16 ? bf16_rne8(p)
                                             : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)op, h);
    }
}

static inline TGT_AVX2 __attribute__((always_inline)) void
loop256(const adam_job *jin, int64_t begin, int64_t end, int gdt, int odt, int sdt)
{
    adam_job c = *jin;  /* see loop512 */
    adam_job *j = &c;
    j->g_dtype = gdt;
    j->out_dtype = odt;
    j->s_mode = sdt;
    if (odt < 0)
        j->out = NULL;
    size_t gsz = j->g_dtype == DT_F32 ? 4 : 2;
    size_t ssz = sdt == ST_F32 ? 4 : 2;
    char *mb = (char *)j->m, *vb = (char *)j->v, *vmb = (char *)j->vmax;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        adam8(j, j->p + i, mb + i * ssz, vb + i * ssz, j->amsgrad ? vmb + i * ssz : NULL,
              (const char *)j->g + i * gsz, j->out ? (char *)j->out + i * 2 : NULL,
              j->idx0 + (uint32_t)i);
    int64_t rem = end - i;
    if (rem > 0) {
        float p[8] = {0}, m[8] = {0}, v[8] = {0}, vm[8] = {0}, g[8] = {0};
        uint16_t o[8];
        size_t fb = (size_t)rem * 4, sb = (size_t)rem * ssz;
        memcpy(p, j->p + i, fb);
        memcpy(m, mb + i * ssz, sb);
        memcpy(v, vb + i * ssz, sb);
        if (j->amsgrad)
            memcpy(vm, vmb + i * ssz, sb);
        memcpy(g, (const char *)j->g + i * gsz, (size_t)rem * gsz);
        adam8(j, p, m, v, vm, g, j->out ? o : NULL, j->idx0 + (uint32_t)i);
        memcpy(j->p + i, p, fb);
        memcpy(mb + i * ssz, m, sb);
        memcpy(vb + i * ssz, v, sb);
        if (j->amsgrad)
            memcpy(vmb + i * ssz, vm, sb);
        if (j->out)
            memcpy((char *)j->out + i * 2, o, (size_t)rem * 2);
    }
}

/* Every (grad dtype, output dtype, state mode) gets its own loop with the three
 * as constants, so the per-element branches on them fold away. */
#define TM_CASES(LOOP)                                                              \
    TM_CASE(LOOP, DT_F32, -1) TM_CASE(LOOP, DT_F32, DT_BF16) TM_CASE(LOOP, DT_F32, DT_F16) \
    TM_CASE(LOOP, DT_BF16, -1) TM_CASE(LOOP, DT_BF16, DT_BF16)                          \
    TM_CASE(LOOP, DT_BF16, DT_F16) TM_CASE(LOOP, DT_F16, -1)                            \
    TM_CASE(LOOP, DT_F16, DT_BF16) TM_CASE(LOOP, DT_F16, DT_F16)
#define TM_CASE(LOOP, G, O)                                                         \
    if (j->g_dtype == G && odt == O) {                                              \
        if (j->s_mode == ST_F32)                                                    \
            LOOP(j, begin, end, G, O, ST_F32);                                      \
        else if (j->s_mode == ST_BF16_RNE)                                          \
            LOOP(j, begin, end, G, O, ST_BF16_RNE);                                 \
        else                                                                        \
            LOOP(j, begin, end, G, O, ST_BF16_SR);                                  \
        return;                                                                     \
    }

static TGT_AVX2 void adam_avx2(const adam_job *j, int64_t begin, int64_t end)
{
    int odt = j->out ? j->out_dtype : -1;
    TM_CASES(loop256)
}

/* -- AVX-512 path (16 lanes; the ragged tail uses masked loads and stores) ------- */

#define TGT_AVX512 TM_TGT_AVX512

static inline TGT_AVX512 __attribute__((always_inline)) __m512
load16(const void *base, int64_t i, __mmask16 k, int sdt)
{
    if (sdt == ST_F32)
        return _mm512_maskz_loadu_ps(k, (const float *)base + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline TGT_AVX512 __attribute__((always_inline)) __m256i
bf16_sr16(__m512 x, __m512i r)
{
    __m512i u = _mm512_castps_si512(x);
    return pack_bf16_16(_mm512_srli_epi32(_mm512_add_epi32(u, r), 16), x);
}

static inline TGT_AVX512 __attribute__((always_inline)) void
store16(void *base, int64_t i, __mmask16 k, __m512 x, int sdt, __m512i r, int hi)
{
    if (sdt == ST_F32) {
        _mm512_mask_storeu_ps((float *)base + i, k, x);
        return;
    }
    __m256i h;
    if (sdt == ST_BF16_RNE)
        h = bf16_rne16(x);
    else
        h = bf16_sr16(x, hi ? _mm512_srli_epi32(r, 16)
                            : _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)));
    _mm256_mask_storeu_epi16((uint16_t *)base + i, k, h);
}

static inline TGT_AVX512 __attribute__((always_inline)) void
adam16(const adam_job *j, int64_t i, __mmask16 k, int nt)
{
    int sdt = j->s_mode;
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
    __m512 m = load16(j->m, i, k, sdt);
    __m512 v = load16(j->v, i, k, sdt);
    tm_moments16(&j->k, &g, &p, &m, &v);
    __m512 vv = v;
    if (j->amsgrad) {
        __m512 a = load16(j->vmax, i, k, sdt);
        __mmask16 un = _mm512_cmp_ps_mask(a, v, _CMP_UNORD_Q);
        vv = _mm512_mask_mov_ps(_mm512_max_ps(a, v), un,
                                _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
    }
    p = tm_param_step16(&j->k, p, m, vv);
    _mm512_mask_storeu_ps(j->p + i, k, p);
    __m512i r = sdt == ST_BF16_SR ? sr_bits16(j->idx0 + (uint32_t)i, j->k0, j->k1)
                                  : _mm512_setzero_si512();
    store16(j->m, i, k, m, sdt, r, 0);
    store16(j->v, i, k, v, sdt, r, 1);
    if (j->amsgrad)
        store16(j->vmax, i, k, vv, sdt, r, 1);
    if (j->out) {
        __m256i h;
        if (j->out_dtype == DT_BF16)
            h = bf16_rne16(p);
        else
            h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (nt)
            _mm256_stream_si256((__m256i *)((uint16_t *)j->out + i), h);
        else
            _mm256_mask_storeu_epi16((uint16_t *)j->out + i, k, h);
    }
}

/* Each core has few cores' worth of bandwidth to draw on here (2 vCPUs), so how many
 * cache lines are on their way matters: the sqrt and two divides of each vector keep
 * the out-of-order window from reaching far ahead, and on Intel cores the hardware
 * prefetcher stops at every 4 KiB page. Asking for the lines TM_ADAM_PF elements ahead
 * of the update, in every array it reads, keeps the memory busy while the divider
 * works: 0.87-0.89x the pass's time on a Sapphire Rapids-class Xeon. On AMD Zen 4 the
 * same prefetches make the fp32 pass 1.1-1.25x slower (its hardware prefetcher already
 * runs ahead and the extra requests compete with it; a prefetch to L2 instead of L1 is
 * no better than none), so j->pf follows the CPU (tm_adam_get_prefetch). adam_lowbit.c
 * prefetches everywhere: its int8 pass is 0.95x with them on Zen 4 too. The arithmetic
 * is untouched either way. */
#define TM_ADAM_PF 1024

static inline TGT_AVX512 __attribute__((always_inline)) void
prefetch16(const adam_job *j, int64_t i, int64_t end, int gdt, int sdt)
{
    int64_t a = i + TM_ADAM_PF;
    if (!j->pf || a >= end)
        return;
    size_t gsz = gdt == DT_F32 ? 4 : 2, ssz = sdt == ST_F32 ? 4 : 2;
    _mm_prefetch((const char *)(j->p + a), _MM_HINT_T0);
    _mm_prefetch((const char *)j->g + a * gsz, _MM_HINT_T0);
    _mm_prefetch((const char *)j->m + a * ssz, _MM_HINT_T0);
    _mm_prefetch((const char *)j->v + a * ssz, _MM_HINT_T0);
    if (j->amsgrad)
        _mm_prefetch((const char *)j->vmax + a * ssz, _MM_HINT_T0);
}

/* The job is copied to a local whose address never escapes, so its fields live
 * in registers rather than being reloaded after every store through a float
 * pointer; gdt/odt/sdt are literal constants at each call site below. */
static inline TGT_AVX512 __attribute__((always_inline)) void
loop512(const adam_job *jin, int64_t begin, int64_t end, int gdt, int odt, int sdt)
{
    adam_job c = *jin;
    adam_job *j = &c;
    j->g_dtype = gdt;
    j->out_dtype = odt;
    j->s_mode = sdt;
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
        for (; i + 16 <= end; i += 16) {
            prefetch16(j, i, end, gdt, sdt);
            adam16(j, i, (__mmask16)0xFFFF, 1);
        }
        _mm_sfence();
    } else {
        for (; i + 16 <= end; i += 16) {
            prefetch16(j, i, end, gdt, sdt);
            adam16(j, i, (__mmask16)0xFFFF, 0);
        }
    }
    if (i < end)
        adam16(j, i, (__mmask16)((1u << (end - i)) - 1u), 0);
}

static TGT_AVX512 void adam_avx512(const adam_job *j, int64_t begin, int64_t end)
{
    int odt = j->out ? j->out_dtype : -1;
    TM_CASES(loop512)
}

#undef TM_CASE
#undef TM_CASES

#endif /* TM_X86 */

/* The software prefetch of the AVX-512 loops (why it depends on the CPU: above). */
static int prefetch_mode = -1;  /* tm_adam_set_prefetch's; -1: by the CPU */

int tm_adam_set_prefetch(int mode)
{
    if (mode < -1 || mode > 1)
        return 0;
    __atomic_store_n(&prefetch_mode, mode, __ATOMIC_RELAXED);
    return 1;
}

int tm_adam_get_prefetch(void)
{
    int mode = __atomic_load_n(&prefetch_mode, __ATOMIC_RELAXED);
    if (mode >= 0)
        return mode;
#if TM_X86
    __builtin_cpu_init();
    return !__builtin_cpu_is("amd");
#else
    return 0;  /* the prefetching paths are x86 only */
#endif
}

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
    int crc_mask;  /* TM_CRC_* arrays to checksum, 0 for none */
    uint32_t *chunk_crcs;  /* 4 per TM_ADAM_CHUNK piece: p, m, v, vmax (in crc_mask) */
    /* Several runs in one pass (tm_adam_step_runs; 0 for one run, job and n): run r is
     * jobs[r] over lens[r] elements, its chunks numbered from starts[r]; starts[nruns]
     * is the total. No CRCs then. */
    int nruns;
    const adam_job *jobs;
    const int64_t *lens, *starts;
    int64_t chunk;  /* elements a chunk (stream_chunk()); hashed in TM_ADAM_CHUNK pieces */
} adam_task;

/* A pass that hashes updates and hashes a chunk TM_ADAM_CHUNK elements at a time, each
 * piece from cache right after its update (chunk_crcs holds a CRC per piece). */
static int64_t stream_chunk(int64_t n, int nthreads)
{
    return tm_stream_chunk(n, nthreads, TM_ADAM_CHUNK, TM_ADAM_STREAM_CHUNK);
}

enum { TM_CRC_P = 1, TM_CRC_M = 2, TM_CRC_V = 4, TM_CRC_VMAX = 8 };

/* Bytes per element of array a (0 = p, 1 = m, 2 = v, 3 = vmax) and its base. */
static size_t crc_elem(const adam_job *j, int a)
{
    return a == 0 || j->s_mode == ST_F32 ? 4 : 2;
}

static const char *crc_base(const adam_job *j, int a)
{
    return a == 0 ? (const char *)j->p : a == 1 ? j->m : a == 2 ? j->v : j->vmax;
}

static void hash_chunk(const adam_task *t, int64_t k, int64_t b, int64_t e)
{
    for (int a = 0; a < 4; a++) {
        if (!(t->crc_mask & (1 << a)))
            continue;
        size_t sz = crc_elem(t->job, a);
        t->chunk_crcs[4 * k + a] = tm_crc32c(0, crc_base(t->job, a) + b * sz,
                                             (size_t)(e - b) * sz);
    }
}

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

/* fn over elements [b, e) of job j, the ones from j->tail_from on with torch's
 * scalar-loop arithmetic: at most 7 elements of a tensor, so the scalar path. */
static void update_range(adam_fn fn, const adam_job *j, int64_t b, int64_t e)
{
    if (j->tail_from >= e) {
        fn(j, b, e);
        return;
    }
    if (b < j->tail_from)
        fn(j, b, j->tail_from);
    adam_job c = *j;
    c.k.torch_tail = 1;
    adam_scalar(&c, b > j->tail_from ? b : j->tail_from, e);
}

/* Take chunks until none are left: a thread slowed by other work on its core
 * simply takes fewer of them. */
static void run_runs(adam_task *t);

static void run_chunks(adam_task *t)
{
    if (t->nruns) {
        run_runs(t);
        return;
    }
    int64_t nchunks = (t->n + t->chunk - 1) / t->chunk;
    for (;;) {
        int64_t k = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (k >= nchunks)
            return;
        int64_t b = k * t->chunk;
        int64_t e = b + t->chunk < t->n ? b + t->chunk : t->n;
        if (!t->crc_mask) {
            update_range(t->fn, t->job, b, e);
            continue;
        }
        /* piece by piece, each hashed right after its update, while it is in cache */
        for (int64_t pb = b; pb < e; pb += TM_ADAM_CHUNK) {
            int64_t pe = pb + TM_ADAM_CHUNK < e ? pb + TM_ADAM_CHUNK : e;
            update_range(t->fn, t->job, pb, pe);
            hash_chunk(t, pb / TM_ADAM_CHUNK, pb, pe);
        }
    }
}

/* run_chunks over several runs: the chunks are numbered across the runs, so a thread
 * that finishes its part of one run goes on into the next instead of waiting at a
 * join (each thread's chunk numbers only grow, so its run index only moves forward). */
static void run_runs(adam_task *t)
{
    int64_t total = t->starts[t->nruns];
    int r = 0;
    for (;;) {
        int64_t k = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (k >= total)
            return;
        while (k >= t->starts[r + 1])
            r++;
        int64_t b = (k - t->starts[r]) * t->chunk;
        int64_t e = b + t->chunk < t->lens[r] ? b + t->chunk : t->lens[r];
        update_range(t->fn, &t->jobs[r], b, e);
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

/* Set in a child forked after this library was loaded: libgomp's team is gone
 * there (its threads were not copied) and a parallel region would wait for them
 * forever, so the child runs on the pool below. */
static volatile int forked;

/* After fork only the forking thread exists in the child: forget the workers. */
static void atfork_child(void)
{
    forked = 1;
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.nworkers = 0;
    pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

/* At load, not at the first call: a fork between the two must mark the child too. */
__attribute__((constructor)) static void register_atfork_at_load(void)
{
    pthread_once(&atfork_once, register_atfork);
}

/* OpenMP's threads only for a call from the process's main thread, whose team is the
 * one ATen's ops use (the one whose worker is awake after them). From another thread
 * (tiermem's overlap worker, updating during backward) a region would make a second
 * team, whose idle worker spins for milliseconds after each call on a core backward's
 * team is computing on; the pool's workers sleep at once. */
static volatile int openmp_allowed = 1;  /* tm_adam_set_openmp's */

static int on_torch_team(void)
{
#ifdef _OPENMP
    return openmp_allowed && !forked && gettid() == getpid();
#else
    return 0;
#endif
}

int tm_adam_openmp(void)
{
    return on_torch_team();
}

void tm_adam_set_openmp(int allowed)
{
    openmp_allowed = !!allowed;
}

void tm_parallel_pieces(void *(*fn)(void *), void *pieces, size_t stride, int parts)
{
    char *base = pieces;
#ifdef _OPENMP
    if (parts > 1 && on_torch_team()) {
        /* the team ATen's ops use, as run_threaded's pass (why: on_torch_team) */
#pragma omp parallel for num_threads(parts) schedule(static, 1)
        for (int k = 0; k < parts; k++)
            fn(base + (size_t)k * stride);
        return;
    }
#endif
    pthread_t tid[parts > 1 ? parts : 1];
    int started[parts > 1 ? parts : 1];
    for (int k = 1; k < parts; k++)
        started[k] = pthread_create(&tid[k], NULL, fn, base + (size_t)k * stride) == 0;
    fn(base);
    for (int k = 1; k < parts; k++) {
        if (started[k])
            pthread_join(tid[k], NULL);
        else
            fn(base + (size_t)k * stride);  /* no thread: do its piece here */
    }
}

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

/* CRCs of the arrays in crc_mask over [0, n), from the chunk CRCs, in order. */
static void join_crcs(const adam_task *t, uint32_t crcs[4])
{
    int64_t npieces = (t->n + TM_ADAM_CHUNK - 1) / TM_ADAM_CHUNK;
    for (int a = 0; a < 4; a++) {
        if (!(t->crc_mask & (1 << a)))
            continue;
        size_t sz = crc_elem(t->job, a);
        uint32_t c = 0;
        for (int64_t k = 0; k < npieces; k++) {
            int64_t len = k == npieces - 1 ? t->n - k * TM_ADAM_CHUNK : TM_ADAM_CHUNK;
            c = tm_crc32c_combine(c, t->chunk_crcs[4 * k + a], (uint64_t)len * sz);
        }
        crcs[a] = c;
    }
}

/* Run task t (n elements in all) on up to nthreads threads, the caller among them. */
static void run_task(adam_task *t, int64_t n, int nthreads)
{
    int parts = 1;
    if (n >= TM_ADAM_PAR_MIN && nthreads > 1) {
        int64_t most = n / TM_ADAM_PAR_UNIT;
        parts = nthreads < most ? nthreads : (int)most;
        if (parts > TM_ADAM_MAX_THREADS + 1)
            parts = TM_ADAM_MAX_THREADS + 1;
    }
    if (parts <= 1) {
        if (t->crc_mask || t->nruns)
            run_chunks(t);  /* chunk by chunk: each is hashed while in cache */
        else
            update_range(t->fn, t->job, 0, n);
        return;
    }
#ifdef _OPENMP
    if (on_torch_team()) {
        /* One region per call: the team's threads take chunks like the pool's would;
         * t lives on the caller's stack until the region's closing barrier. */
#pragma omp parallel num_threads(parts)
        run_chunks(t);
        return;
    }
#endif
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.mu);
    int workers = grow_pool(parts - 1);
    if (parts > workers + 1)
        parts = workers + 1;
    if (parts > 1) {
        pool.task = t;
        pool.parts = parts;
        pool.pending = parts - 1;
        pool.gen++;
        pthread_cond_broadcast(&pool.work);
    }
    pthread_mutex_unlock(&pool.mu);
    run_chunks(t);
    pthread_mutex_lock(&pool.mu);
    while (pool.pending > 0)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.call);
}

static void run_threaded(const adam_job *j, adam_fn fn, int64_t n, int nthreads,
                         int crc_mask, uint32_t *chunk_crcs)
{
    adam_task t = {j, fn, n, 0, crc_mask, chunk_crcs, 0, NULL, NULL, NULL,
                   stream_chunk(n, nthreads)};
    run_task(&t, n, nthreads);
}

/* -- entry point ------------------------------------------------------------------ */

static void advance(adam_job *j, int64_t k)
{
    size_t ssz = j->s_mode == ST_F32 ? 4 : 2;
    j->p += k;
    j->m = (char *)j->m + k * ssz;
    j->v = (char *)j->v + k * ssz;
    if (j->vmax)
        j->vmax = (char *)j->vmax + k * ssz;
    j->g = (const char *)j->g + k * (j->g_dtype == DT_F32 ? 4 : 2);
    if (j->out)
        j->out = (char *)j->out + k * 2;
    if (j->tail_from != INT64_MAX)
        j->tail_from = j->tail_from > k ? j->tail_from - k : 0;
}

/* Stream the low-precision copy past the caches once the pass moves more than an
 * L3 holds (32 MiB: a Zen 4 CCD's; sysconf's figure in a VM is the host's total):
 * nothing reads the copy before the next forward, by which time the rest of the
 * pass has evicted it, so a plain store's read of the line first is wasted. On
 * Zen 4, alternated in one process: the bf16-mixed offload step (5.6M-element
 * passes) about 0.95x the time with streaming (faster in 13 of 14 steps); one pass
 * repeated over 1M elements (16 MiB, cached) 1.08x, so small passes keep plain
 * stores. */
static int stream_out(int64_t n, int grad_dtype, int amsgrad, int state_mode, const void *out)
{
    size_t moved = 4 + (grad_dtype == DT_F32 ? 4 : 2) + (amsgrad ? 3 : 2) *
                   (state_mode == ST_F32 ? 4 : 2) + 2;
    return out != NULL && (uint64_t)n * moved >= ((uint64_t)32 << 20);
}

int tm_adam_step(float *p, void *exp_avg, void *exp_avg_sq, void *max_exp_avg_sq,
                 const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 double step, int amsgrad, int maximize, int decoupled, int state_mode,
                 uint64_t seed, uint64_t index0, int nthreads)
{
    return tm_adam_step_crc(p, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, grad_dtype, out,
                            out_dtype, n, lr, beta1, beta2, eps, weight_decay, step, amsgrad,
                            maximize, decoupled, state_mode, seed, index0, nthreads, 0, NULL,
                            0);
}

int tm_adam_step_crc(float *p, void *exp_avg, void *exp_avg_sq, void *max_exp_avg_sq,
                     const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     double step, int amsgrad, int maximize, int decoupled, int state_mode,
                     uint64_t seed, uint64_t index0, int nthreads, int crc_mask,
                     uint32_t *crcs, int64_t tail_len)
{
    if (n < 0 || grad_dtype < DT_F32 || grad_dtype > DT_F16 || tail_len < 0 || tail_len > n)
        return -EINVAL;
    if (crc_mask < 0 || crc_mask > 15 || (crc_mask && !crcs) ||
        ((crc_mask & TM_CRC_VMAX) && !amsgrad))
        return -EINVAL;
    if (crc_mask) {
        for (int a = 0; a < 4; a++)
            if (crc_mask & (1 << a))
                crcs[a] = 0;  /* the CRC of nothing, for n == 0 */
    }
    if (out && out_dtype != DT_BF16 && out_dtype != DT_F16)
        return -EINVAL;
    if (state_mode < ST_F32 || state_mode > ST_BF16_SR)
        return -EINVAL;
    if (n == 0)
        return 0;
    if (!p || !exp_avg || !exp_avg_sq || !grad || (amsgrad && !max_exp_avg_sq))
        return -EINVAL;

    adam_job j = {
        .p = p, .m = exp_avg, .v = exp_avg_sq, .vmax = amsgrad ? max_exp_avg_sq : NULL,
        .g = grad, .out = out, .g_dtype = grad_dtype, .out_dtype = out_dtype,
        .s_mode = state_mode, .amsgrad = !!amsgrad,
        .tail_from = tail_len ? n - tail_len : INT64_MAX,
        .k = tm_adam_coef_make(lr, beta1, beta2, eps, weight_decay, step, maximize, decoupled),
    };
    j.nt_out = stream_out(n, grad_dtype, amsgrad, state_mode, out);
    j.pf = tm_adam_get_prefetch();
    adam_fn fn = fn_for(tm_adam_get_isa());
    uint32_t *chunk_crcs = NULL;
    if (crc_mask) {
        /* 4 CRCs per piece of the longest window run (n at most). */
        chunk_crcs = malloc(sizeof(uint32_t) * 4 * (size_t)((n + TM_ADAM_CHUNK - 1) /
                                                            TM_ADAM_CHUNK));
        if (!chunk_crcs)
            return -ENOMEM;
    }
    /* Element i draws its rounding bits from stream index index0 + i. The hash
     * takes 32 bits of index, so the stream is cut into 2^32-element windows, each
     * with its own key from (seed, window number); a call that crosses a window
     * boundary runs once per window. */
    for (int64_t done = 0; done < n;) {
        uint64_t at = index0 + (uint64_t)done;
        int64_t len = n - done;
        if (state_mode == ST_BF16_SR) {
            uint64_t room = ((uint64_t)1 << 32) - (at & 0xFFFFFFFFu);
            if ((uint64_t)len > room)
                len = (int64_t)room;
            uint64_t key = splitmix64(seed ^ splitmix64(at >> 32));
            j.k0 = (uint32_t)key;
            j.k1 = (uint32_t)(key >> 32);
        }
        j.idx0 = (uint32_t)at;
        run_threaded(&j, fn, len, nthreads, crc_mask, chunk_crcs);
        if (crc_mask) {
            uint32_t win[4];
            adam_task t = {&j, fn, len, 0, crc_mask, chunk_crcs, 0, NULL, NULL, NULL,
                           TM_ADAM_CHUNK};
            join_crcs(&t, win);
            for (int a = 0; a < 4; a++)
                if (crc_mask & (1 << a))
                    crcs[a] = tm_crc32c_combine(crcs[a], win[a],
                                                (uint64_t)len * crc_elem(&j, a));
        }
        advance(&j, len);
        done += len;
    }
    free(chunk_crcs);
    return 0;
}

int tm_adam_step_runs(const tm_adam_run *runs, int nruns, double lr, double beta1,
                      double beta2, double eps, double weight_decay, int amsgrad,
                      int maximize, int decoupled, int nthreads)
{
    if (nruns < 0 || (nruns && !runs))
        return -EINVAL;
    for (int r = 0; r < nruns; r++) {
        const tm_adam_run *u = &runs[r];
        if (u->n < 0 || u->grad_dtype < DT_F32 || u->grad_dtype > DT_F16 || u->step < 1 ||
            u->tail_len < 0 || u->tail_len > u->n)
            return -EINVAL;
        if (u->out && u->out_dtype != DT_BF16 && u->out_dtype != DT_F16)
            return -EINVAL;
        if (u->n && (!u->p || !u->exp_avg || !u->exp_avg_sq || !u->grad ||
                     (amsgrad && !u->max_exp_avg_sq)))
            return -EINVAL;
    }
    adam_job *jobs = malloc(sizeof(adam_job) * (size_t)(nruns ? nruns : 1));
    int64_t *lens = malloc(sizeof(int64_t) * (size_t)(nruns ? nruns : 1));
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(nruns + 1));
    if (!jobs || !lens || !starts) {
        free(jobs);
        free(lens);
        free(starts);
        return -ENOMEM;
    }
    int pf = tm_adam_get_prefetch();
    int m = 0;  /* runs with elements */
    int64_t total = 0;
    starts[0] = 0;
    for (int r = 0; r < nruns; r++) {
        const tm_adam_run *u = &runs[r];
        if (u->n == 0)
            continue;
        /* Each run is what tm_adam_step would do with it (fp32 moments): its own
         * coefficients (the step count is a run's) and its own choice of streaming the
         * low-precision copy. */
        jobs[m] = (adam_job){
            .p = u->p, .m = u->exp_avg, .v = u->exp_avg_sq,
            .vmax = amsgrad ? u->max_exp_avg_sq : NULL, .g = u->grad, .out = u->out,
            .g_dtype = u->grad_dtype, .out_dtype = u->out_dtype, .s_mode = ST_F32,
            .amsgrad = !!amsgrad,
            .nt_out = stream_out(u->n, u->grad_dtype, amsgrad, ST_F32, u->out),
            .pf = pf,
            .tail_from = u->tail_len ? u->n - u->tail_len : INT64_MAX,
            .k = tm_adam_coef_make(lr, beta1, beta2, eps, weight_decay, u->step, maximize,
                                   decoupled),
        };
        lens[m] = u->n;
        total += u->n;
        m++;
    }
    int64_t chunk = stream_chunk(total, nthreads);
    for (int r = 0; r < m; r++)
        starts[r + 1] = starts[r] + (lens[r] + chunk - 1) / chunk;
    if (m > 0) {
        adam_fn fn = fn_for(tm_adam_get_isa());
        adam_task t = {&jobs[0], fn, lens[0], 0, 0, NULL, m, jobs, lens, starts, chunk};
        run_task(&t, total, nthreads);
    }
    free(jobs);
    free(lens);
    free(starts);
    return 0;
}
