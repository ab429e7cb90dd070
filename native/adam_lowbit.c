/* The Adam/AdamW update with 8-bit moments (optimizer.state_dtype: int8), and the
 * master-less weight formats of bf16 models (optimizer.master_weights), in one pass.
 *
 * Moments are stored blockwise: each run of QB = 256 elements (a call's first
 * block starts at its element 0; its last may be short) keeps one fp32 scale per
 * moment and one byte per element. A byte is a small float relative to the
 * scale (a "dynamic exponent" code, like fp8 but with the exponent range chosen
 * per moment):
 *
 *   exp_avg     sign, 4-bit exponent (bias 15), 3-bit mantissa
 *   exp_avg_sq  no sign, 5-bit exponent (bias 31), 3-bit mantissa
 *
 * A magnitude code c >= 8 stands for (1 + (c & 7) / 8) * 2^((c >> 3) - bias); 0
 * for zero (stored +0: the sign of a zero moment is not kept), 1 for NaN (any non-finite moment is stored as NaN), 2..7 are
 * unused. The largest code is 1.875; the scale is the power of two that puts the
 * block's largest finite magnitude in (0.9375, 1.875], so scaling is exact (a
 * dequantised block quantises back to itself; magnitudes of 2^126 and more lose
 * bits to fp32 subnormals) and every value keeps 3 mantissa bits (relative error at
 * most 1/16) down to 2^-14 (exp_avg) or 2^-30 (exp_avg_sq) of the block's largest.
 * The second moment gets the wider range because it holds squares. Below the
 * range, exp_avg rounds to 0 or the smallest code; exp_avg_sq rounds *up* to
 * the smallest code, never to 0: a zero denominator would turn a tiny exp_avg
 * into a step of lr * m / eps. A block whose scale would be 0 or subnormal is
 * all zeros.
 *
 * Per block: dequantise (code value * old scale), the Adam moments of adam.c in
 * fp32, the parameter step from those fp32 moments with the bias corrections folded
 * into one division (param_step_q1: p + nssq * m / (sqrt(v) + epsq), nssq = -(lr / bc1)
 * * sqrt(bc2) and epsq = eps * sqrt(bc2) rounded once from doubles; adam.c's
 * p + nss * m / (sqrt(v) / sqrt(bc2) + eps) is the same quantity with two divisions,
 * which made the divider this pass's bottleneck on an AVX2 CPU (Zen 1: 1.71 against
 * 1.53 ns/param); the two differ by an ulp or so, far inside the codes' 1/16), then
 * the new scales from the block's fp32 moments and the codes, rounded to nearest even
 * or stochastically: 16 random bits per element and moment (code_bits(index0 + i):
 * exp_avg the low 16, exp_avg_sq the high 16), added below the kept mantissa, then
 * truncated, so the rounding is unbiased and a decaying exp_avg_sq keeps moving
 * instead of freezing at a code.
 *
 * The codes' random bits are the Weyl step x = idx * SR_W + k0 of numeric.h's sr_bits
 * without its mixing: exp_avg takes x's top half, exp_avg_sq the top half of x + k1.
 * Stochastic rounding needs, for each element over the steps, bits uniform and
 * independent of the value and of the other moment's bits: k0 and k1 are a fresh
 * splitmix64 key each step (state_seed: step and parameter), so for every idx x is
 * uniform, and x + k1 uniform and independent of it. Within one step the elements' bits
 * form a lattice (SR_W / 2^32 is the golden ratio's fraction, a low-discrepancy
 * sequence) instead of independent draws: each element still rounds without bias, and
 * a block of equal values rounds up in a share nearer its expectation. sr_bits' mixing
 * (two 32-bit multiplies per element) was the largest single cost of the AVX2 pass on
 * Zen 1 (vpmulld: 4 cycles per 8 lanes): 1.58 against 1.38 ns/param, 32M elements,
 * 2 threads. bf16 moments and master_weights none keep sr_bits.
 *
 * Weights (master_mode): 0 fp32 p (a master in the record, or an fp32 model),
 * with an optional bf16/fp16 copy written out as adam.c does; 1 kahan: p is the
 * bf16 model weight and comp a bf16 compensation term in the record, the update
 * runs on p + comp in fp32, the new weight is rounded to nearest even and the
 * rounding error is kept in comp (rounded to nearest); 2 none: p is the bf16
 * model weight, updated in fp32 and rounded back stochastically with the bits of
 * a second key (so they are independent of the moments' bits).
 *
 * The same weight formats also run with dense moments (moment_dtype fp32 or bf16:
 * optimizer.state_dtype fp32/bf16 with master_weights kahan/none): no blocks and no
 * scales, each element's moments read, updated by the same arithmetic and stored back,
 * bf16 ones rounded to nearest even or stochastically with sr_bits' bits (exp_avg the
 * low 16, exp_avg_sq the high 16 of sr_bits(index0 + i)). Only the moments' load and
 * store, and those bits, differ from the int8 pass.
 *
 * fp16 weights (w16: kahan with an fp16 term, none rounded stochastically to fp16) take
 * the same steps with fp16's rounding: nearest even (subnormals and overflow to inf
 * as IEEE), every NaN the canonical 0x7E00; a Kahan term is 0 once the weight
 * overflowed to inf (p - inf would turn the next step's p + term into NaN). Stochastic
 * rounding to fp16 (f16_sr) keeps the 16 random bits' meaning across fp16's
 * subnormals: the fraction of an fp16 spacing that x lies above the fp16 value below
 * it (toward zero), cut to 16 bits, plus the 16 random bits, carries 1 or 0 into that
 * value; the spacing is 2^-24 below 2^-14 (subnormals), so there more bits are dropped.
 * Above 65504 a carry gives inf (as rounding to nearest does from 65520 on), from
 * 65536 on every value is inf.
 *
 * Dense moments also take amsgrad (vmax: max_exp_avg_sq in the moments' format): as
 * adam.c, vmax = max(vmax, v) with any NaN giving NaN, the step uses it, and a bf16
 * vmax is rounded with exp_avg_sq's bits, so rounding keeps vmax >= exp_avg_sq.
 *
 * Paths: AVX-512 (F, BW, VL), AVX2 (+ FMA, F16C) and portable scalar C, bitwise the same (every
 * operation is correctly rounded, -ffp-contract=off, fmaf() where the vector
 * path uses an FMA). Large calls are split over threads by chunks of whole
 * blocks; CRC32C of each array written (crc_mask) is taken chunk by chunk right
 * after the chunk was updated, by the thread that updated it. */
#define _GNU_SOURCE
#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numeric.h"
#include "parallel.h"
#include "tiermem_native.h"

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

enum { LB_F32 = 0, LB_BF16 = 1, LB_F16 = 2 };
enum { MW_FP32 = 0, MW_KAHAN = 1, MW_NONE = 2 };
enum { MF_INT8 = 0, MF_F32 = 1, MF_BF16 = 2 };  /* the moments' format */
enum { CRC_P = 1, CRC_M = 2, CRC_MS = 4, CRC_V = 8, CRC_VS = 16, CRC_COMP = 32 };
#define LB_NARRAYS 6

#define QB 256                    /* elements per quantisation block */
#define LB_CHUNK (64 * 1024)      /* a hashed piece: this many elements (whole blocks) */
#define LB_STREAM_CHUNK (1024 * 1024)  /* threads take chunks of up to this many (pieces) */
#define LB_PAR_MIN (256 * 1024)   /* below this, no threads */
#define LB_MAX_THREADS 64
#define M_EBIAS 112u              /* 127 - 15: exp_avg's exponent bias, rebased */
#define V_EBIAS 96u               /* 127 - 31: exp_avg_sq's */
#define Q_TOP 1.875f              /* the largest code's value */
#define Q_NAN 1u
#define W_KEY 0xA511E9B3u         /* second key word for the weights' bits (none) */

typedef struct lb_job {
    void *p;             /* float (MW_FP32) or uint16_t bf16 (the model's weight) */
    uint16_t *comp;      /* MW_KAHAN */
    uint8_t *m, *v;      /* MF_INT8: codes; else fp32 or bf16 values (cast at use) */
    void *vmax;          /* amsgrad's max_exp_avg_sq (dense moments only), or NULL */
    float *ms, *vs;      /* one scale per block (MF_INT8) */
    const void *g;
    void *out;           /* MW_FP32 only: bf16/fp16 copy of p, or NULL */
    int g_dtype, out_dtype, mw, sr, mf;
    int w16;             /* MW_KAHAN / MW_NONE: the weights (and term) are fp16, not bf16 */
    uint32_t idx0, k0, k1;
    tm_adam_coef k;      /* the Adam arithmetic's coefficients (numeric.h) */
    float nssq, epsq;    /* int8 moments' parameter step (param_step_q1) */
} lb_job;

/* -- scalar ------------------------------------------------------------------------ */

static inline float dec_m(uint8_t c, float s)
{
    uint32_t mag = c & 0x7Fu, bits;
    if (mag == Q_NAN)
        bits = 0x7FC00000u;
    else
        bits = (mag >= 8 ? (mag << 20) + (M_EBIAS << 23) : 0u) | ((uint32_t)(c & 0x80u) << 24);
    return f32_from_bits(bits) * s;
}

static inline float dec_v(uint8_t c, float s)
{
    uint32_t bits = c == Q_NAN ? 0x7FC00000u : c >= 8 ? ((uint32_t)c << 20) + (V_EBIAS << 23)
                                                      : 0u;
    return f32_from_bits(bits) * s;
}

/* The code of x (a = |x| / scale, as a * inv) at mantissa bits t; r16: random bits. */
static inline uint32_t enc_norm(uint32_t u, uint32_t ebias, int sr, uint32_t r16, uint32_t top)
{
    uint32_t t = u - (ebias << 23);
    uint32_t rnd = sr ? ((r16 << 4) | 8u) : (0x7FFFFu + ((t >> 20) & 1u));
    uint32_t c = (t + rnd) >> 20;
    return c > top ? top : c;
}

/* The codes' random bits of element idx (the top of the file): exp_avg the low 16. */
static inline uint32_t code_bits(uint32_t idx, uint32_t k0, uint32_t k1)
{
    uint32_t x = sr_weyl(idx, k0);
    return (x >> 16) | ((x + k1) & 0xFFFF0000u);
}

static inline uint8_t enc_m(float x, float inv, int sr, uint32_t r16)
{
    float ax = fabsf(x);
    if (!(ax < INFINITY))
        return Q_NAN;
    float a = ax * inv;
    uint32_t u = f32_bits(a), c;
    if (u >= ((M_EBIAS + 1) << 23)) {
        c = enc_norm(u, M_EBIAS, sr, r16, 0x7Fu);
    } else {
        float t = a * 0x1p14f;  /* below the smallest code, in its units: [0, 1) */
        float thr = sr ? (65535.5f - (float)r16) * 0x1p-16f : 0.5f;
        c = t >= thr ? 8u : 0u;
    }
    return (uint8_t)(c | (x < 0.0f && c ? 0x80u : 0u));  /* zero is stored +0 */
}

static inline uint8_t enc_v(float x, float inv, int sr, uint32_t r16)
{
    float ax = fabsf(x);
    if (!(ax < INFINITY))
        return Q_NAN;
    float a = ax * inv;
    uint32_t u = f32_bits(a);
    if (u >= ((V_EBIAS + 1) << 23))
        return (uint8_t)enc_norm(u, V_EBIAS, sr, r16, 0xFFu);
    return a > 0.0f ? 8u : 0u;  /* up, never to 0 (see the top of the file) */
}

/* The scale of a block from its largest finite magnitude: the power of two that puts
 * it in (0.9375, 1.875], so scaling is exact both ways (a dequantised block quantises
 * back to the same codes and scale); 0 below FLT_MIN. */
static inline void block_scale(float amax, float *scale, float *inv)
{
    if (!(amax >= FLT_MIN)) {
        *scale = *inv = 0.0f;
        return;
    }
    float s = f32_from_bits(f32_bits(amax) & 0x7F800000u);
    if (amax > Q_TOP * s && s < 0x1p127f)
        s *= 2.0f;
    *scale = s;
    *inv = 1.0f / s;
}

static inline float load_g1(const lb_job *j, int64_t i)
{
    if (j->g_dtype == LB_F32)
        return ((const float *)j->g)[i];
    uint16_t h = ((const uint16_t *)j->g)[i];
    return j->g_dtype == LB_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* amsgrad's max, NaN if either is (adam.c's max_nan). */
static inline float lb_max_nan(float a, float b)
{
    if (a != a || b != b)
        return f32_from_bits(0xFFFFFFFFu);
    return a > b ? a : b;
}

/* fp16 to nearest even, every NaN the canonical 0x7E00. */
static inline uint16_t f16w_rne(float f)
{
    return f != f ? 0x7E00u : f32_to_f16(f);
}

/* Stochastic rounding of f to fp16 with 16 random bits r (see the top of the file). */
static inline uint16_t f16w_sr(float f, uint32_t r)
{
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return 0x7E00u;
    if (a >= 0x47800000u)
        return (uint16_t)(sign | 0x7C00u);
    uint32_t e = a >> 23, base, q;
    if (a >= 0x38800000u) {  /* fp16 normal: 13 bits dropped */
        base = (a - (112u << 23)) >> 13;
        q = (a & 0x1FFFu) << 3;
    } else {                 /* fp16 subnormal: 126 - e bits dropped (at most 40 counted) */
        uint32_t sh = 126u - e < 40u ? 126u - e : 40u;
        uint64_t m24 = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
        uint64_t rem = m24 & ((1ull << sh) - 1);
        base = (uint32_t)(m24 >> sh);
        q = (uint32_t)(sh >= 16 ? rem >> (sh - 16) : rem << (16 - sh));
    }
    return (uint16_t)(sign | (base + ((q + r) >> 16)));
}

/* The model's low-precision weight (or Kahan term) i as fp32. */
static inline float load_w1(const lb_job *j, const uint16_t *w, int64_t i)
{
    return j->w16 ? f16_to_f32(w[i]) : bf16_to_f32(w[i]);
}

/* kahan: the weight p rounded to nearest into w[i], the rounding error into comp[i]. */
static inline void store_kahan1(const lb_job *j, int64_t i, float p)
{
    uint16_t *w = (uint16_t *)j->p;
    if (j->w16) {
        uint16_t nb = f16w_rne(p);
        w[i] = nb;
        j->comp[i] = (nb & 0x7FFFu) == 0x7C00u ? 0u : f16w_rne(p - f16_to_f32(nb));
    } else {
        uint16_t nb = f32_to_bf16(p);
        w[i] = nb;
        j->comp[i] = f32_to_bf16(p - bf16_to_f32(nb));
    }
}

static inline void store_none1(const lb_job *j, int64_t i, float p)
{
    uint32_t rw = sr_bits(j->idx0 + (uint32_t)i, j->k0 ^ W_KEY, j->k1) & 0xFFFFu;
    ((uint16_t *)j->p)[i] = j->w16 ? f16w_sr(p, rw) : f32_to_bf16_sr(p, rw);
}

/* Element i of the weight the update runs on, per master_weights: the fp32 master, the
 * low-precision weight plus its Kahan term, or the low-precision weight alone. */
static inline float load_p1(const lb_job *j, int64_t i)
{
    if (j->mw == MW_FP32)
        return ((float *)j->p)[i];
    if (j->mw == MW_KAHAN)
        return load_w1(j, (uint16_t *)j->p, i) + load_w1(j, j->comp, i);
    return load_w1(j, (uint16_t *)j->p, i);
}

/* The updated weight p stored back in load_p1's format (and the model's low-precision
 * copy of an fp32 master, when asked for). */
static inline void store_p1(const lb_job *j, int64_t i, float p)
{
    if (j->mw == MW_FP32) {
        ((float *)j->p)[i] = p;
        if (j->out) {
            uint16_t *o = (uint16_t *)j->out;
            o[i] = j->out_dtype == LB_BF16 ? f32_to_bf16(p) : f32_to_f16(p);
        }
    } else if (j->mw == MW_KAHAN) {
        store_kahan1(j, i, p);
    } else {
        store_none1(j, i, p);
    }
}

/* The parameter step of int8 moments (the top of the file): one division, not two. */
static inline float param_step_q1(const lb_job *j, float p, float m, float v)
{
    return p + (j->nssq * m) / (sqrtf(v) + j->epsq);
}

/* Pass 1 on element i of an int8 block: its moments dequantised in *m, *v, the Adam step,
 * the weight stored; the new fp32 moments come back in *m, *v. */
static inline void update1(const lb_job *j, int64_t i, float *m, float *v)
{
    float g = load_g1(j, i), p = load_p1(j, i);
    tm_moments1(&j->k, &g, &p, m, v);
    store_p1(j, i, param_step_q1(j, p, *m, *v));
}

static void block_scalar(const lb_job *j, int64_t b0, int len)
{
    float tm[QB], tv[QB];
    int64_t blk = b0 / QB;
    float ms = j->ms[blk], vs = j->vs[blk], am = 0.0f, av = 0.0f;
    for (int k = 0; k < len; k++) {
        int64_t i = b0 + k;
        float m = dec_m(j->m[i], ms), v = dec_v(j->v[i], vs);
        update1(j, i, &m, &v);
        tm[k] = m;
        tv[k] = v;
        float a = fabsf(m);
        if (a < INFINITY && a > am)
            am = a;
        a = fabsf(v);
        if (a < INFINITY && a > av)
            av = a;
    }
    float ims, ivs;
    block_scale(am, &ms, &ims);
    block_scale(av, &vs, &ivs);
    j->ms[blk] = ms;
    j->vs[blk] = vs;
    for (int k = 0; k < len; k++) {
        int64_t i = b0 + k;
        uint32_t r = j->sr ? code_bits(j->idx0 + (uint32_t)i, j->k0, j->k1) : 0u;
        j->m[i] = enc_m(tm[k], ims, j->sr, r & 0xFFFFu);
        j->v[i] = enc_v(tv[k], ivs, j->sr, r >> 16);
    }
}

/* One element with dense moments (MF_F32, MF_BF16): the weights as block_scalar does
 * them, the moments stored in their format. */
static void dense_scalar(const lb_job *j, int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++) {
        float g = load_g1(j, i), p, m, v;
        if (j->mf == MF_F32) {
            m = ((float *)j->m)[i];
            v = ((float *)j->v)[i];
        } else {
            m = bf16_to_f32(((uint16_t *)j->m)[i]);
            v = bf16_to_f32(((uint16_t *)j->v)[i]);
        }
        p = load_p1(j, i);
        tm_moments1(&j->k, &g, &p, &m, &v);
        float vv = v;
        if (j->vmax)
            vv = lb_max_nan(j->mf == MF_F32 ? ((float *)j->vmax)[i]
                                            : bf16_to_f32(((uint16_t *)j->vmax)[i]), v);
        p = tm_param_step1(&j->k, p, m, vv);
        store_p1(j, i, p);
        if (j->mf == MF_F32) {
            ((float *)j->m)[i] = m;
            ((float *)j->v)[i] = v;
            if (j->vmax)
                ((float *)j->vmax)[i] = vv;
        } else if (j->sr) {
            uint32_t r = sr_bits(j->idx0 + (uint32_t)i, j->k0, j->k1);
            ((uint16_t *)j->m)[i] = f32_to_bf16_sr(m, r & 0xFFFFu);
            ((uint16_t *)j->v)[i] = f32_to_bf16_sr(v, r >> 16);
            if (j->vmax)
                ((uint16_t *)j->vmax)[i] = f32_to_bf16_sr(vv, r >> 16);
        } else {
            ((uint16_t *)j->m)[i] = f32_to_bf16(m);
            ((uint16_t *)j->v)[i] = f32_to_bf16(v);
            if (j->vmax)
                ((uint16_t *)j->vmax)[i] = f32_to_bf16(vv);
        }
    }
}

/* -- AVX-512 ----------------------------------------------------------------------- */

#if TM_X86
#define TGT_LB TM_TGT_AVX512

/* The codes' values before scaling, from the codes widened to 32 bits (exp_avg's sign
 * extended, exp_avg_sq's zero extended): any code. */
static inline TGT_LB __attribute__((always_inline)) __m512i
dec_m16_bits(__m512i c)
{
    __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    __mmask16 norm = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(8));
    __m512i bits = _mm512_maskz_mov_epi32(norm, _mm512_add_epi32(
        _mm512_slli_epi32(mag, 20), _mm512_set1_epi32((int)(M_EBIAS << 23))));
    bits = _mm512_or_si512(bits, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)),
                                                   24));
    return _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(Q_NAN)),
                                 _mm512_set1_epi32((int)0x7FC00000u));
}

static inline TGT_LB __attribute__((always_inline)) __m512i
dec_v16_bits(__m512i c)
{
    __mmask16 norm = _mm512_cmpge_epu32_mask(c, _mm512_set1_epi32(8));
    __m512i bits = _mm512_maskz_mov_epi32(norm, _mm512_add_epi32(
        _mm512_slli_epi32(c, 20), _mm512_set1_epi32((int)(V_EBIAS << 23))));
    return _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(Q_NAN)),
                                 _mm512_set1_epi32((int)0x7FC00000u));
}

/* Both moments' values of 16 codes (lanes km; the rest decode as 0). When every code is
 * a number (>= 8, the usual case) each value is its code moved into place, the exponent
 * bias added by an OR (the code's bits and the bias's do not overlap: exp_avg's sign
 * extended code shifted left 20 has its sign in bits 27-31, which (x | 0x38000000) &
 * 0xBFF00000 turns into bit 31 and the bias 112 << 23), bit for bit the general path. */
static inline TGT_LB __attribute__((always_inline)) void
dec16(const lb_job *j, int64_t i, __mmask16 km, float ms, float vs, __m512 *m, __m512 *v)
{
    __m512i cm = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(km, j->m + i));
    __m512i cv = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(km, j->v + i));
    __mmask16 num = _mm512_test_epi32_mask(cm, _mm512_set1_epi32(0x78)) &
                    _mm512_test_epi32_mask(cv, _mm512_set1_epi32(0xF8));
    __m512i bm, bv;
    if (num == (__mmask16)0xFFFF) {
        bm = _mm512_ternarylogic_epi32(_mm512_slli_epi32(cm, 20),
                                       _mm512_set1_epi32((int)(M_EBIAS << 23)),
                                       _mm512_set1_epi32((int)0xBFF00000u), 0xA8);
        bv = _mm512_or_si512(_mm512_slli_epi32(cv, 20),
                             _mm512_set1_epi32((int)(V_EBIAS << 23)));
    } else {
        bm = dec_m16_bits(cm);
        bv = dec_v16_bits(cv);
    }
    *m = _mm512_mul_ps(_mm512_castsi512_ps(bm), _mm512_set1_ps(ms));
    *v = _mm512_mul_ps(_mm512_castsi512_ps(bv), _mm512_set1_ps(vs));
}

/* dec16 on 16 codes of a block that block_decodes_fast() cleared (every code a number,
 * exp_avg_sq's scale 2^k with the values normal): the numbers' paths of dec16, exp_avg_sq's
 * multiply by 2^k done as an add of k to the exponent (vbias: (V_EBIAS + k) << 23), which
 * is exact for normal results, so bit for bit dec16. */
static inline TGT_LB __attribute__((always_inline)) void
dec16_fast(const lb_job *j, int64_t i, float ms, __m512i vbias, __m512 *m, __m512 *v)
{
    __m512i cm = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(j->m + i)));
    __m512i cv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->v + i)));
    __m512i bm = _mm512_ternarylogic_epi32(_mm512_slli_epi32(cm, 20),
                                           _mm512_set1_epi32((int)(M_EBIAS << 23)),
                                           _mm512_set1_epi32((int)0xBFF00000u), 0xA8);
    *m = _mm512_mul_ps(_mm512_castsi512_ps(bm), _mm512_set1_ps(ms));
    *v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(cv, 20), vbias));
}

/* Whether dec16_fast may decode the full block at b (old exp_avg_sq scale vs): all its
 * codes numbers (exp_avg magnitude and exp_avg_sq code >= 8, tested 64 bytes at a time),
 * and vs a power of two 2^k with 2^-30 * 2^k normal (the smallest code's value; k <= 127
 * keeps the largest finite). *vbias: what dec16_fast adds. */
static inline TGT_LB __attribute__((always_inline)) int
block_decodes_fast(const lb_job *j, int64_t b, float vs, __m512i *vbias)
{
    uint32_t sb = f32_bits(vs);
    if ((sb & 0x807FFFFFu) || (sb >> 23) < 31u || (sb >> 23) > 254u)
        return 0;
    __mmask64 ok = ~(__mmask64)0;
    for (int q = 0; q < QB; q += 64) {
        ok &= _mm512_test_epi8_mask(_mm512_loadu_si512(j->m + b + q), _mm512_set1_epi8(0x78));
        ok &= _mm512_test_epi8_mask(_mm512_loadu_si512(j->v + b + q),
                                    _mm512_set1_epi8((char)0xF8));
    }
    *vbias = _mm512_set1_epi32((int)(sb - (31u << 23)));
    return ok == ~(__mmask64)0;
}

static inline TGT_LB __attribute__((always_inline)) __m512i
enc_norm16(__m512i u, uint32_t ebias, int sr, __m512i r16, uint32_t top)
{
    __m512i t = _mm512_sub_epi32(u, _mm512_set1_epi32((int)(ebias << 23)));
    __m512i rnd = sr ? _mm512_or_si512(_mm512_slli_epi32(r16, 4), _mm512_set1_epi32(8))
                     : _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), _mm512_and_si512(
                           _mm512_srli_epi32(t, 20), _mm512_set1_epi32(1)));
    __m512i c = _mm512_srli_epi32(_mm512_add_epi32(t, rnd), 20);
    return _mm512_min_epu32(c, _mm512_set1_epi32((int)top));
}

static inline TGT_LB __attribute__((always_inline)) __m512i
enc_m16(__m512 x, float inv, int sr, __m512i r16)
{
    __m512 ax = _mm512_abs_ps(x);
    __m512 a = _mm512_mul_ps(ax, _mm512_set1_ps(inv));
    __m512i u = _mm512_castps_si512(a);
    __mmask16 norm = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32((int)((M_EBIAS + 1) << 23)));
    __m512i c = enc_norm16(u, M_EBIAS, sr, r16, 0x7F);
    if (norm != (__mmask16)0xFFFF) {  /* some lane below the smallest code: rare */
        __m512 t = _mm512_mul_ps(a, _mm512_set1_ps(0x1p14f));
        __m512 thr = sr ? _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(65535.5f),
                                                      _mm512_cvtepi32_ps(r16)),
                                        _mm512_set1_ps(0x1p-16f))
                        : _mm512_set1_ps(0.5f);
        __mmask16 up = _mm512_cmp_ps_mask(t, thr, _CMP_GE_OQ);
        c = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(up, _mm512_set1_epi32(8)), norm, c);
    }
    c = _mm512_mask_or_epi32(c, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) &
                                    _mm512_test_epi32_mask(c, c),
                             c, _mm512_set1_epi32(0x80));
    return _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(ax, _mm512_set1_ps(INFINITY),
                                                       _CMP_NLT_UQ),
                                 _mm512_set1_epi32(Q_NAN));
}

static inline TGT_LB __attribute__((always_inline)) __m512i
enc_v16(__m512 x, float inv, int sr, __m512i r16)
{
    __m512 ax = _mm512_abs_ps(x);
    __m512 a = _mm512_mul_ps(ax, _mm512_set1_ps(inv));
    __m512i u = _mm512_castps_si512(a);
    __mmask16 norm = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32((int)((V_EBIAS + 1) << 23)));
    __m512i c = enc_norm16(u, V_EBIAS, sr, r16, 0xFF);
    if (norm != (__mmask16)0xFFFF) {
        __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
        c = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(pos, _mm512_set1_epi32(8)), norm, c);
    }
    return _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(ax, _mm512_set1_ps(INFINITY),
                                                       _CMP_NLT_UQ),
                                 _mm512_set1_epi32(Q_NAN));
}

static inline TGT_LB __attribute__((always_inline)) __m512
bf16x16(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fp16 to nearest even (vcvtps2ph: IEEE, subnormals and overflow included), every NaN the
 * canonical 0x7E00: f16w_rne on 16 lanes. */
static inline TGT_LB __attribute__((always_inline)) __m256i
f16_rne16(__m512 x)
{
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                 _mm256_set1_epi16(0x7E00));
}

/* f16w_sr on 16 lanes (r16: the random bits, one per 32-bit lane). Subnormal lanes drop
 * sh = 126 - e bits (14..40; vpsrlvd/vpsllvd give 0 for counts of 32 and more, as the
 * scalar path's 64-bit shifts give for what is left below the 16 bits kept). */
static inline TGT_LB __attribute__((always_inline)) __m256i
f16_sr16(__m512 x, __m512i r16)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000));
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i e = _mm512_srli_epi32(a, 23);
    __mmask16 normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x38800000));
    __m512i sh = _mm512_min_epu32(_mm512_sub_epi32(_mm512_set1_epi32(126), e),
                                  _mm512_set1_epi32(40));
    __m512i m24 = _mm512_or_si512(
        _mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF)),
        _mm512_maskz_mov_epi32(_mm512_cmpgt_epu32_mask(e, _mm512_setzero_si512()),
                               _mm512_set1_epi32(0x800000)));
    __m512i rem = _mm512_and_si512(m24, _mm512_sub_epi32(
        _mm512_sllv_epi32(_mm512_set1_epi32(1), sh), _mm512_set1_epi32(1)));
    __m512i base = _mm512_srlv_epi32(m24, sh);
    __m512i q = _mm512_mask_mov_epi32(
        _mm512_sllv_epi32(rem, _mm512_sub_epi32(_mm512_set1_epi32(16), sh)),
        _mm512_cmpge_epu32_mask(sh, _mm512_set1_epi32(16)),
        _mm512_srlv_epi32(rem, _mm512_sub_epi32(sh, _mm512_set1_epi32(16))));
    base = _mm512_mask_mov_epi32(base, normal, _mm512_srli_epi32(
        _mm512_sub_epi32(a, _mm512_set1_epi32((int)(112u << 23))), 13));
    q = _mm512_mask_mov_epi32(q, normal, _mm512_slli_epi32(
        _mm512_and_si512(a, _mm512_set1_epi32(0x1FFF)), 3));
    __m512i h = _mm512_add_epi32(base, _mm512_srli_epi32(_mm512_add_epi32(q, r16), 16));
    h = _mm512_mask_mov_epi32(h, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x47800000)),
                              _mm512_set1_epi32(0x7C00));
    h = _mm512_or_si512(h, sign);
    h = _mm512_mask_mov_epi32(h, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
                              _mm512_set1_epi32(0x7E00));
    return _mm512_cvtepi32_epi16(h);
}

static inline TGT_LB __attribute__((always_inline)) __m512
w16x16(__m256i h, int w16)
{
    return w16 ? _mm512_cvtph_ps(h) : bf16x16(h);
}

/* param_step_q1 on 16 lanes */
static inline TGT_LB __attribute__((always_inline)) __m512
param_step_q16(const lb_job *j, __m512 p, __m512 m, __m512 v)
{
    __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(j->epsq));
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(j->nssq), m), denom));
}

/* Pass 1 on 16 elements (lanes km) at i, their moments dequantised in *mo, *vo: the Adam
 * step (q: int8 moments', param_step_q16; else adam.c's), the weights stored; the new fp32
 * moments come back in *mo, *vo. */
static inline TGT_LB __attribute__((always_inline)) void
update16(const lb_job *j, int64_t i, __mmask16 km, int gdt, int mw, int w16, int odt, int q,
         __m512 *mo, __m512 *vo, __m512 *vx)
{
    __m512 g;
    if (gdt == LB_F32) {
        g = _mm512_maskz_loadu_ps(km, (const float *)j->g + i);
    } else {
        __m256i h = _mm256_maskz_loadu_epi16(km, (const uint16_t *)j->g + i);
        g = gdt == LB_BF16 ? bf16x16(h) : _mm512_cvtph_ps(h);
    }
    __m512 p;
    if (mw == MW_FP32) {
        p = _mm512_maskz_loadu_ps(km, (const float *)j->p + i);
    } else {
        p = w16x16(_mm256_maskz_loadu_epi16(km, (const uint16_t *)j->p + i), w16);
        if (mw == MW_KAHAN)
            p = _mm512_add_ps(p, w16x16(_mm256_maskz_loadu_epi16(km, j->comp + i), w16));
    }
    __m512 m = *mo, v = *vo, vv;
    tm_moments16(&j->k, &g, &p, &m, &v);
    vv = v;
    if (vx) {  /* amsgrad: *vx holds the old vmax, gets the new one */
        __mmask16 un = _mm512_cmp_ps_mask(*vx, v, _CMP_UNORD_Q);
        vv = _mm512_mask_mov_ps(_mm512_max_ps(*vx, v), un,
                                _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
        *vx = vv;
    }
    p = q ? param_step_q16(j, p, m, vv) : tm_param_step16(&j->k, p, m, vv);
    if (mw == MW_FP32) {
        _mm512_mask_storeu_ps((float *)j->p + i, km, p);
        if (odt >= 0) {
            __m256i h = odt == LB_BF16 ? bf16_rne16(p)
                : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_mask_storeu_epi16((uint16_t *)j->out + i, km, h);
        }
    } else if (mw == MW_KAHAN && w16) {
        __m256i nb = f16_rne16(p);
        __m256i c = f16_rne16(_mm512_sub_ps(p, _mm512_cvtph_ps(nb)));
        __mmask16 inf = _mm256_cmpeq_epi16_mask(
            _mm256_and_si256(nb, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x7C00));
        _mm256_mask_storeu_epi16((uint16_t *)j->p + i, km, nb);
        _mm256_mask_storeu_epi16(j->comp + i, km, _mm256_maskz_mov_epi16((__mmask16)~inf, c));
    } else if (mw == MW_KAHAN) {
        __m256i nb = bf16_rne16(p);
        _mm256_mask_storeu_epi16((uint16_t *)j->p + i, km, nb);
        _mm256_mask_storeu_epi16(j->comp + i, km, bf16_rne16(_mm512_sub_ps(p, bf16x16(nb))));
    } else {
        __m512i rw = _mm512_and_si512(sr_bits16(j->idx0 + (uint32_t)i, j->k0 ^ W_KEY, j->k1),
                                      _mm512_set1_epi32(0xFFFF));
        __m256i nb;
        if (w16) {
            nb = f16_sr16(p, rw);
        } else {
            __m512i u = _mm512_castps_si512(p);
            nb = pack_bf16_16(_mm512_srli_epi32(_mm512_add_epi32(u, rw), 16), p);
        }
        _mm256_mask_storeu_epi16((uint16_t *)j->p + i, km, nb);
    }
    *mo = m;
    *vo = v;
}

/* code_bits from the Weyl step x of 16 elements */
static inline TGT_LB __attribute__((always_inline)) __m512i
code_mix16(__m512i x, uint32_t k1)
{
    return _mm512_or_si512(_mm512_srli_epi32(x, 16),
                           _mm512_and_si512(_mm512_add_epi32(x, _mm512_set1_epi32((int)k1)),
                                            _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Pass 2 on 16 elements, any values: the codes of fp32 moments m, v at the block's new
 * scales (inverses ims, ivs), stored; x: the Weyl step of their random bits. */
static inline TGT_LB __attribute__((always_inline)) void
encode16(const lb_job *j, int64_t i, __mmask16 km, __m512 m, __m512 v, float ims, float ivs,
         int sr, __m512i x)
{
    __m512i r = sr ? code_mix16(x, j->k1) : _mm512_setzero_si512();
    __m512i cm = enc_m16(m, ims, sr, _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)));
    __m512i cv = enc_v16(v, ivs, sr, _mm512_srli_epi32(r, 16));
    _mm512_mask_cvtepi32_storeu_epi8(j->m + i, km, cm);
    _mm512_mask_cvtepi32_storeu_epi8(j->v + i, km, cv);
}

/* Pass 2 on 16 elements of a block that moment_scale() cleared: every moment finite, in
 * the normal range of the codes and normal itself (exp_avg_sq also >= 0), the new scale
 * 2^k. Then a = |x| * 2^-k has the bits of |x| less k << 23, and enc_norm16's code is
 * (bits(|x|) - ((ebias + k) << 23) + rnd) >> 20, never above the top code: with the
 * subtraction and the rounding's constant folded into cm_add, cv_add (see
 * moment_scale), and (stochastic) the random bits in bits 4..19, which the constant's
 * low bits (8, or 0x7FFFF for nearest) do not touch, so an OR puts them together.
 * exp_avg's sign: its bit 31 is left in the sum (nothing below carries into it) and
 * moved to the code's bit 7. Bit for bit encode16's codes. */
static inline TGT_LB __attribute__((always_inline)) void
encode16_fast(const lb_job *j, int64_t i, __m512 m, __m512 v, uint32_t cm_add,
              uint32_t cv_add, int sr, __m512i x)
{
    __m512i um = _mm512_castps_si512(m), uv = _mm512_castps_si512(v), rm, rv;
    if (sr) {
        __m512i r = code_mix16(x, j->k1);
        rm = _mm512_ternarylogic_epi32(_mm512_slli_epi32(r, 4), _mm512_set1_epi32(0xFFFF0),
                                       _mm512_set1_epi32((int)cm_add), 0xEA);
        rv = _mm512_ternarylogic_epi32(_mm512_srli_epi32(r, 12), _mm512_set1_epi32(0xFFFF0),
                                       _mm512_set1_epi32((int)cv_add), 0xEA);
    } else {  /* bit 20 of bits(a) is bit 20 of bits(|x|) */
        rm = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(um, 20), _mm512_set1_epi32(1)),
                              _mm512_set1_epi32((int)cm_add));
        rv = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(uv, 20), _mm512_set1_epi32(1)),
                              _mm512_set1_epi32((int)cv_add));
    }
    __m512i sm = _mm512_add_epi32(um, rm), sv = _mm512_add_epi32(uv, rv);
    /* (sm >> 20) & 0x7F: the magnitude's code; (sm >> 24) & 0x80: the sign */
    __m512i cm = _mm512_ternarylogic_epi32(_mm512_srli_epi32(sm, 20), _mm512_srli_epi32(sm, 24),
                                           _mm512_set1_epi32(0x7F), 0xE4);
    __m512i cv = _mm512_srli_epi32(sv, 20);
    _mm_storeu_si128((__m128i *)(j->m + i), _mm512_cvtepi32_epi8(cm));
    _mm_storeu_si128((__m128i *)(j->v + i), _mm512_cvtepi32_epi8(cv));
}

/* A block's moments in pass 1: the largest and smallest magnitude bits per lane (as
 * unsigned integers they order like the magnitudes, NaN and infinity above all).
 * exp_avg_sq's bits are taken as they are: it is +0 or more, or NaN (a sum of
 * products of a number with itself and of non-negative factors); were it ever negative
 * (or -0), its sign bit would put it above infinity and the block on the full path. */
typedef struct {
    __m512i mmax, mmin, vmax, vmin;
} lb_range;

static inline TGT_LB __attribute__((always_inline)) void
range_reset(lb_range *q)
{
    q->mmax = q->vmax = _mm512_setzero_si512();
    q->mmin = q->vmin = _mm512_set1_epi32(-1);
}

static inline TGT_LB __attribute__((always_inline)) void
range_add(lb_range *q, __m512 m, __m512 v, __mmask16 km)
{
    __m512i am = _mm512_castps_si512(_mm512_abs_ps(m));
    __m512i av = _mm512_castps_si512(v);  /* >= +0 or NaN: see moment_scale */
    q->mmax = _mm512_mask_max_epu32(q->mmax, km, q->mmax, am);
    q->mmin = _mm512_mask_min_epu32(q->mmin, km, q->mmin, am);
    q->vmax = _mm512_mask_max_epu32(q->vmax, km, q->vmax, av);
    q->vmin = _mm512_mask_min_epu32(q->vmin, km, q->vmin, av);
}

/* The largest finite magnitude among the n values at x (a block with NaN or infinity). */
static inline TGT_LB __attribute__((always_inline)) float
finite_max(const float *x, int n)
{
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) {
        __mmask16 km = n - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - k)) - 1u);
        __m512 a = _mm512_abs_ps(_mm512_maskz_load_ps(km, x + k));
        acc = _mm512_mask_max_ps(acc, km & _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY),
                                                              _CMP_LT_OQ), acc, a);
    }
    return _mm512_reduce_max_ps(acc);
}

/* One moment's new scale (stored at *scale) and inverse, and whether encode16_fast may
 * code the block: all finite, its smallest magnitude at least `lowest` = 2^(ebias - 126)
 * (the smallest code) and its largest at most the top code once scaled, and the scale
 * 2^k large enough that every value is normal (lowest * 2^k >= 2^-126: the scale's
 * exponent field at least minexp = 127 - ebias). *add: the constant encode16_fast adds,
 * the rounding's (8 stochastic, 0x7FFFF nearest) less (ebias + k) << 23, which is
 * bits(scale) - (minexp << 23). */
static inline TGT_LB __attribute__((always_inline)) int
moment_scale(__m512i vmax, __m512i vmin, const float *x, int n, float lowest, uint32_t minexp,
             int sr, float *scale, float *inv, uint32_t *add)
{
    uint32_t hi = _mm512_reduce_max_epu32(vmax), lo = _mm512_reduce_min_epu32(vmin);
    int finite = hi < 0x7F800000u;
    block_scale(finite ? f32_from_bits(hi) : finite_max(x, n), scale, inv);
    uint32_t sb = f32_bits(*scale);
    *add = (sr ? 8u : 0x7FFFFu) - (sb - (minexp << 23));
    return finite && *inv > 0.0f && f32_from_bits(lo) * *inv >= lowest &&
           f32_from_bits(hi) * *inv <= Q_TOP && (sb >> 23) >= minexp;
}

static inline TGT_LB __attribute__((always_inline)) __mmask16
lanes(int left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* As in adam.c: the divider keeps the out-of-order window from reaching far ahead and
 * the hardware prefetcher stops at each 4 KiB page, so the lines LB_PF elements ahead are
 * asked for in every array the update reads. */
#ifndef LB_PF
#define LB_PF 1024
#endif

static inline TGT_LB __attribute__((always_inline)) void
prefetch16(const lb_job *j, int64_t i, int gdt, int mw)
{
    _mm_prefetch((const char *)j->g + (i + LB_PF) * (gdt == LB_F32 ? 4 : 2), _MM_HINT_T0);
    _mm_prefetch((const char *)j->p + (i + LB_PF) * (mw == MW_FP32 ? 4 : 2), _MM_HINT_T0);
    if (mw == MW_KAHAN)
        _mm_prefetch((const char *)(j->comp + i + LB_PF), _MM_HINT_T0);
    _mm_prefetch((const char *)(j->m + i + LB_PF), _MM_HINT_T0);
    _mm_prefetch((const char *)(j->v + i + LB_PF), _MM_HINT_T0);
}

/* A block's codes still to be written: where, its fp32 moments and new scales. */
typedef struct {
    int64_t at;    /* first element, or -1 for none */
    int len, fast;
    float ims, ivs;
    uint32_t madd, vadd;  /* encode16_fast's constants (fast) */
    const float *m, *v;
} lb_pending;

static inline TGT_LB __attribute__((always_inline)) void
encode_block(const lb_job *j, const lb_pending *q, int sr, __m512i *x)
{
    const __m512i step = _mm512_set1_epi32((int)(16u * SR_W));
    for (int k = 0; k < q->len; k += 16) {
        __m512 m = _mm512_load_ps(q->m + k), v = _mm512_load_ps(q->v + k);
        if (q->fast && k + 16 <= q->len)
            encode16_fast(j, q->at + k, m, v, q->madd, q->vadd, sr, *x);
        else
            encode16(j, q->at + k, lanes(q->len - k), m, v, q->ims, q->ivs, sr, *x);
        *x = _mm512_add_epi32(*x, step);
    }
}

/* The blocks of [begin, end). A block's codes need its new scales, so they need all of
 * its fp32 moments first: pass 1 keeps them in a small buffer, pass 2 encodes them. Run
 * one after the other, pass 1 waits on the divider (a sqrt and two divides per vector)
 * while the integer units idle, and pass 2 the other way round. So the two are
 * interleaved: while pass 1 runs on full block b, each of its vectors is followed by
 * pass 2 on the same vector of block b - 1 (two buffers, one per block). Pass 1 decodes
 * with dec16_fast and pass 2 encodes with encode16_fast where the block allows (nearly
 * always). Every element's result is exactly what the plain order gives; the random
 * bits' Weyl step advances vector by vector. */
static inline TGT_LB __attribute__((always_inline)) void
range512(const lb_job *jin, int64_t begin, int64_t end, int gdt, int mw, int w16, int odt,
         int sr)
{
    lb_job c = *jin;  /* a local whose address never escapes: fields stay in registers */
    const lb_job *j = &c;
    float buf[2][2][QB] __attribute__((aligned(64)));  /* [block parity][m, v] */
    lb_pending prev = {.at = -1};
    int cur = 0;
    __m512i x = sr ? sr_weyl16(j->idx0 + (uint32_t)begin, j->k0) : _mm512_setzero_si512();
    const __m512i step = _mm512_set1_epi32((int)(16u * SR_W));
    for (int64_t b = begin; b < end; b += QB) {
        int len = (int)(end - b < QB ? end - b : QB);
        int64_t blk = b / QB;
        float ms = j->ms[blk], vs = j->vs[blk];
        float *tm = buf[cur][0], *tv = buf[cur][1];
        lb_range q;
        range_reset(&q);
        __m512i vbias;
        if (prev.at >= 0 && len == QB && prev.len == QB) {
            int dfast = block_decodes_fast(j, b, vs, &vbias);
#define LB_PIPELINED(DECODE, ENCODE)                                                   \
            for (int k = 0; k < QB; k += 16) {                                         \
                __m512 m, v;                                                           \
                if (b + k + LB_PF < end)                                               \
                    prefetch16(j, b + k, gdt, mw);                                     \
                DECODE;                                                                \
                update16(j, b + k, (__mmask16)0xFFFF, gdt, mw, w16, odt, 1, &m, &v, NULL);        \
                _mm512_store_ps(tm + k, m);                                            \
                _mm512_store_ps(tv + k, v);                                            \
                range_add(&q, m, v, (__mmask16)0xFFFF);                                \
                ENCODE;                                                                \
                x = _mm512_add_epi32(x, step);                                         \
            }
#define LB_DEC_FAST dec16_fast(j, b + k, ms, vbias, &m, &v)
#define LB_DEC_ANY dec16(j, b + k, (__mmask16)0xFFFF, ms, vs, &m, &v)
#define LB_ENC_FAST                                                                    \
            encode16_fast(j, prev.at + k, _mm512_load_ps(prev.m + k),                  \
                          _mm512_load_ps(prev.v + k), prev.madd, prev.vadd, sr, x)
#define LB_ENC_ANY                                                                     \
            encode16(j, prev.at + k, (__mmask16)0xFFFF, _mm512_load_ps(prev.m + k),     \
                     _mm512_load_ps(prev.v + k), prev.ims, prev.ivs, sr, x)
            if (dfast && prev.fast) {
                LB_PIPELINED(LB_DEC_FAST, LB_ENC_FAST)
            } else if (prev.fast) {
                LB_PIPELINED(LB_DEC_ANY, LB_ENC_FAST)
            } else if (dfast) {
                LB_PIPELINED(LB_DEC_FAST, LB_ENC_ANY)
            } else {
                LB_PIPELINED(LB_DEC_ANY, LB_ENC_ANY)
            }
#undef LB_ENC_ANY
#undef LB_ENC_FAST
#undef LB_DEC_ANY
#undef LB_DEC_FAST
#undef LB_PIPELINED
        } else {
            for (int k = 0; k < len; k += 16) {
                __mmask16 km = lanes(len - k);
                __m512 m, v;
                dec16(j, b + k, km, ms, vs, &m, &v);
                update16(j, b + k, km, gdt, mw, w16, odt, 1, &m, &v, NULL);
                _mm512_store_ps(tm + k, m);
                _mm512_store_ps(tv + k, v);
                range_add(&q, m, v, km);
            }
            if (prev.at >= 0)
                encode_block(j, &prev, sr, &x);
        }
        float nms, nvs;
        prev.fast = moment_scale(q.mmax, q.mmin, tm, len, 0x1p-14f, 127u - M_EBIAS, sr, &nms,
                                 &prev.ims, &prev.madd);
        prev.fast &= moment_scale(q.vmax, q.vmin, tv, len, 0x1p-30f, 127u - V_EBIAS, sr, &nvs,
                                  &prev.ivs, &prev.vadd);
        j->ms[blk] = nms;
        j->vs[blk] = nvs;
        prev.at = b;
        prev.len = len;
        prev.m = tm;
        prev.v = tv;
        cur ^= 1;
    }
    if (prev.at >= 0)
        encode_block(j, &prev, sr, &x);
}


/* Dense moments (MF_F32, MF_BF16), 16 elements at a time: load, update16 (the weights
 * exactly as the int8 pass does them), store; the moments' random bits from the same
 * Weyl step as the codes'. Bit for bit dense_scalar. */
static inline TGT_LB __attribute__((always_inline)) void
dense512(const lb_job *jin, int64_t begin, int64_t end, int gdt, int mw, int w16, int odt,
         int mf, int sr)
{
    lb_job c = *jin;
    const lb_job *j = &c;
    const int msz = mf == MF_F32 ? 4 : 2;
    __m512i x = sr ? sr_weyl16(j->idx0 + (uint32_t)begin, j->k0) : _mm512_setzero_si512();
    const __m512i step = _mm512_set1_epi32((int)(16u * SR_W));
    for (int64_t i = begin; i < end; i += 16) {
        __mmask16 km = lanes((int)(end - i < 16 ? end - i : 16));
        if (i + LB_PF < end) {
            _mm_prefetch((const char *)j->g + (i + LB_PF) * (gdt == LB_F32 ? 4 : 2),
                         _MM_HINT_T0);
            _mm_prefetch((const char *)j->p + (i + LB_PF) * (mw == MW_FP32 ? 4 : 2),
                         _MM_HINT_T0);
            if (mw == MW_KAHAN)
                _mm_prefetch((const char *)(j->comp + i + LB_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)j->m + (i + LB_PF) * msz, _MM_HINT_T0);
            _mm_prefetch((const char *)j->v + (i + LB_PF) * msz, _MM_HINT_T0);
        }
        __m512 m, v;
        if (mf == MF_F32) {
            m = _mm512_maskz_loadu_ps(km, (const float *)j->m + i);
            v = _mm512_maskz_loadu_ps(km, (const float *)j->v + i);
        } else {
            m = bf16x16(_mm256_maskz_loadu_epi16(km, (const uint16_t *)j->m + i));
            v = bf16x16(_mm256_maskz_loadu_epi16(km, (const uint16_t *)j->v + i));
        }
        __m512 vx = _mm512_setzero_ps();
        if (j->vmax)
            vx = mf == MF_F32 ? _mm512_maskz_loadu_ps(km, (const float *)j->vmax + i)
                              : bf16x16(_mm256_maskz_loadu_epi16(km,
                                                                 (const uint16_t *)j->vmax + i));
        update16(j, i, km, gdt, mw, w16, odt, 0, &m, &v, j->vmax ? &vx : NULL);
        if (mf == MF_F32) {
            _mm512_mask_storeu_ps((float *)j->m + i, km, m);
            _mm512_mask_storeu_ps((float *)j->v + i, km, v);
            if (j->vmax)
                _mm512_mask_storeu_ps((float *)j->vmax + i, km, vx);
        } else {
            __m256i hm, hv, hx = _mm256_setzero_si256();
            if (sr) {
                __m512i r = sr_mix16(x, j->k1);
                __m512i rv = _mm512_srli_epi32(r, 16);
                hm = pack_bf16_16(_mm512_srli_epi32(_mm512_add_epi32(
                    _mm512_castps_si512(m), _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF))),
                    16), m);
                hv = pack_bf16_16(_mm512_srli_epi32(_mm512_add_epi32(
                    _mm512_castps_si512(v), rv), 16), v);
                if (j->vmax)
                    hx = pack_bf16_16(_mm512_srli_epi32(_mm512_add_epi32(
                        _mm512_castps_si512(vx), rv), 16), vx);
            } else {
                hm = bf16_rne16(m);
                hv = bf16_rne16(v);
                if (j->vmax)
                    hx = bf16_rne16(vx);
            }
            _mm256_mask_storeu_epi16((uint16_t *)j->m + i, km, hm);
            _mm256_mask_storeu_epi16((uint16_t *)j->v + i, km, hv);
            if (j->vmax)
                _mm256_mask_storeu_epi16((uint16_t *)j->vmax + i, km, hx);
        }
        x = _mm512_add_epi32(x, step);
    }
}

/* Each combination gets its own loop with them as constants, in a function of its own:
 * compiled all into one function, the int8 loop kept its Adam coefficients in memory (seven
 * broadcasts per vector) and ran ~5% slower than when its registers are allocated alone. */
enum { LB_NOOUT = -1 };  /* no bf16/fp16 copy of the weights (an enum: pasted into names) */
#define LB_NAME(G, MW, W, O, MF, SR) lb_##G##_##MW##_##W##_##O##_##MF##_##SR
#define LB_DEF(G, MW, W, O, MF, SR)                                                    \
    static TGT_LB __attribute__((noinline)) void                                      \
    LB_NAME(G, MW, W, O, MF, SR)(const lb_job *j, int64_t begin, int64_t end)        \
    {                                                                                  \
        if (MF == MF_INT8)                                                             \
            range512(j, begin, end, G, MW, W, O, SR);                                  \
        else                                                                           \
            dense512(j, begin, end, G, MW, W, O, MF, SR);                              \
    }
#define LB_DEF_MF(G, MW, W, O)                                                         \
    LB_DEF(G, MW, W, O, MF_F32, 0) LB_DEF(G, MW, W, O, MF_BF16, 1)                     \
    LB_DEF(G, MW, W, O, MF_BF16, 0) LB_DEF(G, MW, W, O, MF_INT8, 1)                    \
    LB_DEF(G, MW, W, O, MF_INT8, 0)
#define LB_DEF_MW(G)                                                                   \
    LB_DEF_MF(G, MW_FP32, 0, LB_BF16) LB_DEF_MF(G, MW_FP32, 0, LB_F16)                 \
    LB_DEF_MF(G, MW_FP32, 0, LB_NOOUT) LB_DEF_MF(G, MW_KAHAN, 1, LB_NOOUT)             \
    LB_DEF_MF(G, MW_KAHAN, 0, LB_NOOUT) LB_DEF_MF(G, MW_NONE, 1, LB_NOOUT)             \
    LB_DEF_MF(G, MW_NONE, 0, LB_NOOUT)
LB_DEF_MW(LB_F32)
LB_DEF_MW(LB_BF16)
LB_DEF_MW(LB_F16)

#define LB_SR(G, MW, W, O)                                                             \
    do {                                                                               \
        if (j->mf == MF_F32)                                                           \
            LB_NAME(G, MW, W, O, MF_F32, 0)(j, begin, end);                            \
        else if (j->mf == MF_BF16 && j->sr)                                            \
            LB_NAME(G, MW, W, O, MF_BF16, 1)(j, begin, end);                           \
        else if (j->mf == MF_BF16)                                                     \
            LB_NAME(G, MW, W, O, MF_BF16, 0)(j, begin, end);                           \
        else if (j->sr)                                                                \
            LB_NAME(G, MW, W, O, MF_INT8, 1)(j, begin, end);                           \
        else                                                                           \
            LB_NAME(G, MW, W, O, MF_INT8, 0)(j, begin, end);                           \
    } while (0)
#define LB_OUT(G, MW)                                                                  \
    do {                                                                               \
        if (odt == LB_BF16)                                                            \
            LB_SR(G, MW, 0, LB_BF16);                                                  \
        else if (odt == LB_F16)                                                        \
            LB_SR(G, MW, 0, LB_F16);                                                   \
        else                                                                           \
            LB_SR(G, MW, 0, LB_NOOUT);                                                 \
    } while (0)
#define LB_MW(G)                                                                       \
    do {                                                                               \
        if (j->mw == MW_FP32)                                                          \
            LB_OUT(G, MW_FP32);                                                        \
        else if (j->mw == MW_KAHAN && j->w16)                                          \
            LB_SR(G, MW_KAHAN, 1, LB_NOOUT);                                           \
        else if (j->mw == MW_KAHAN)                                                    \
            LB_SR(G, MW_KAHAN, 0, LB_NOOUT);                                           \
        else if (j->w16)                                                               \
            LB_SR(G, MW_NONE, 1, LB_NOOUT);                                            \
        else                                                                           \
            LB_SR(G, MW_NONE, 0, LB_NOOUT);                                            \
    } while (0)

static TGT_LB void lowbit_avx512(const lb_job *j, int64_t begin, int64_t end)
{
    int odt = j->out ? j->out_dtype : -1;
    if (j->g_dtype == LB_F32)
        LB_MW(LB_F32);
    else if (j->g_dtype == LB_BF16)
        LB_MW(LB_BF16);
    else
        LB_MW(LB_F16);
}

/* -- AVX2 + FMA + F16C (8 lanes) ----------------------------------------------------
 *
 * For CPUs without AVX-512 (AMD before Zen 4, most Intel desktop parts): on this project's
 * Zen 1 host the scalar pass took 12x the fp32 update. The same arithmetic as the scalar
 * path, in the same order, 8 elements at a time; what is rare goes through the scalar
 * helpers lane by lane, so it is their result by construction: decoding a group of codes
 * of which one is 0 or NaN, encoding a group in which one moment is non-finite or below
 * the smallest code, fp16 weights rounded stochastically, and a block's last elements when
 * it is not a multiple of 8 long. */

#define TGT_LB2 TM_TGT_AVX2
#define LB2_INLINE static inline TGT_LB2 __attribute__((always_inline))

LB2_INLINE __m256 w16x8(__m128i h, int w16)
{
    return w16 ? _mm256_cvtph_ps(h) : bf16x8(h);
}

/* f16w_rne on 8 lanes: vcvtps2ph rounds as f32_to_f16 does; NaN lanes 0x7E00. */
LB2_INLINE __m128i f16_rne8(__m256 x)
{
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    return _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan16);
}

/* Both moments of 8 int8 codes at i, dequantised at scales ms, vs: dec_m and dec_v. */
LB2_INLINE void dec8(const lb_job *j, int64_t i, float ms, float vs, __m256 *m, __m256 *v)
{
    __m128i bm = _mm_loadl_epi64((const __m128i *)(j->m + i));
    __m128i bv = _mm_loadl_epi64((const __m128i *)(j->v + i));
    /* a number: exp_avg's magnitude >= 8, exp_avg_sq's code >= 8 */
    __m128i zm = _mm_cmpeq_epi8(_mm_and_si128(bm, _mm_set1_epi8(0x78)), _mm_setzero_si128());
    __m128i zv = _mm_cmpeq_epi8(_mm_and_si128(bv, _mm_set1_epi8((char)0xF8)), _mm_setzero_si128());
    if ((_mm_movemask_epi8(_mm_or_si128(zm, zv)) & 0xFF) == 0) {
        /* (c << 20) + (bias << 23) as an OR (no bits overlap); exp_avg's sign extended
         * code has its sign in bits 27-31, which the mask keeps in bit 31 only */
        __m256i cm = _mm256_cvtepi8_epi32(bm), cv = _mm256_cvtepu8_epi32(bv);
        __m256i um = _mm256_and_si256(
            _mm256_or_si256(_mm256_slli_epi32(cm, 20), _mm256_set1_epi32((int)(M_EBIAS << 23))),
            _mm256_set1_epi32((int)0xBFF00000u));
        __m256i uv = _mm256_or_si256(_mm256_slli_epi32(cv, 20),
                                     _mm256_set1_epi32((int)(V_EBIAS << 23)));
        *m = _mm256_mul_ps(_mm256_castsi256_ps(um), _mm256_set1_ps(ms));
        *v = _mm256_mul_ps(_mm256_castsi256_ps(uv), _mm256_set1_ps(vs));
        return;
    }
    float tm[8], tv[8];
    for (int k = 0; k < 8; k++) {
        tm[k] = dec_m(j->m[i + k], ms);
        tv[k] = dec_v(j->v[i + k], vs);
    }
    *m = _mm256_loadu_ps(tm);
    *v = _mm256_loadu_ps(tv);
}

/* Whether dec8_fast may decode the full block at b: block_decodes_fast's test, 32 codes
 * at a time. *vbias: what dec8_fast adds to exp_avg_sq's code bits. */
LB2_INLINE int block_decodes_fast8(const lb_job *j, int64_t b, float vs, __m256i *vbias)
{
    uint32_t sb = f32_bits(vs);
    if ((sb & 0x807FFFFFu) || (sb >> 23) < 31u || (sb >> 23) > 254u)
        return 0;
    __m256i bad = _mm256_setzero_si256();
    for (int q = 0; q < QB; q += 32) {
        __m256i bm = _mm256_loadu_si256((const __m256i *)(j->m + b + q));
        __m256i bv = _mm256_loadu_si256((const __m256i *)(j->v + b + q));
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(
            _mm256_and_si256(bm, _mm256_set1_epi8(0x78)), _mm256_setzero_si256()));
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(
            _mm256_and_si256(bv, _mm256_set1_epi8((char)0xF8)), _mm256_setzero_si256()));
    }
    *vbias = _mm256_set1_epi32((int)(sb - (31u << 23)));
    return _mm256_movemask_epi8(bad) == 0;
}

/* dec8 on 8 codes of a block that block_decodes_fast8() cleared: dec16_fast's arithmetic
 * (exp_avg_sq's power-of-two scale an add to the exponent), so bit for bit dec8. */
LB2_INLINE void dec8_fast(const lb_job *j, int64_t i, float ms, __m256i vbias, __m256 *m,
                          __m256 *v)
{
    __m256i cm = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(j->m + i)));
    __m256i cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(j->v + i)));
    __m256i um = _mm256_and_si256(
        _mm256_or_si256(_mm256_slli_epi32(cm, 20), _mm256_set1_epi32((int)(M_EBIAS << 23))),
        _mm256_set1_epi32((int)0xBFF00000u));
    *m = _mm256_mul_ps(_mm256_castsi256_ps(um), _mm256_set1_ps(ms));
    *v = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(cv, 20), vbias));
}

/* param_step_q1 on 8 lanes, in its two halves: the denominator (square root) and the
 * step (division) from it, which range256 takes in different passes */
LB2_INLINE __m256 denom_q8(const lb_job *j, __m256 v)
{
    return _mm256_add_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(j->epsq));
}

LB2_INLINE __m256 param_step_q8(const lb_job *j, __m256 p, __m256 m, __m256 denom)
{
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(j->nssq), m), denom));
}

/* update1's moments of the 8 elements at i: *mo, *vo in, updated out; *po: the weights
 * the step starts from (weight decay applied, a Kahan term added) */
LB2_INLINE void moments8(const lb_job *j, int64_t i, int gdt, int mw, int w16, __m256 *po,
                         __m256 *mo, __m256 *vo)
{
    __m256 g;
    if (gdt == LB_F32) {
        g = _mm256_loadu_ps((const float *)j->g + i);
    } else {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)j->g + i));
        g = gdt == LB_BF16 ? bf16x8(h) : _mm256_cvtph_ps(h);
    }
    __m256 p;
    if (mw == MW_FP32) {
        p = _mm256_loadu_ps((const float *)j->p + i);
    } else {
        p = w16x8(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->p + i)), w16);
        if (mw == MW_KAHAN)
            p = _mm256_add_ps(p, w16x8(_mm_loadu_si128((const __m128i *)(j->comp + i)), w16));
    }
    tm_moments8(&j->k, &g, &p, mo, vo);
    *po = p;
}

/* update1's stores of the 8 stepped weights p at i: the fp32 master and its low-precision
 * copy, the bf16/fp16 weights with their Kahan term, or rounded stochastically (none) */
LB2_INLINE void store_param8(const lb_job *j, int64_t i, int mw, int w16, int odt, __m256 p)
{
    uint16_t *w = (uint16_t *)j->p + i;
    if (mw == MW_FP32) {
        _mm256_storeu_ps((float *)j->p + i, p);
        if (odt >= 0)
            _mm_storeu_si128((__m128i *)((uint16_t *)j->out + i),
                             odt == LB_BF16 ? bf16_rne8(p)
                                            : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT |
                                                                     _MM_FROUND_NO_EXC));
    } else if (mw == MW_KAHAN && w16) {
        __m128i nb = f16_rne8(p);
        __m128i t = f16_rne8(_mm256_sub_ps(p, _mm256_cvtph_ps(nb)));
        /* no term once the weight overflowed to inf */
        __m128i inf = _mm_cmpeq_epi16(_mm_and_si128(nb, _mm_set1_epi16(0x7FFF)),
                                      _mm_set1_epi16(0x7C00));
        _mm_storeu_si128((__m128i *)w, nb);
        _mm_storeu_si128((__m128i *)(j->comp + i), _mm_andnot_si128(inf, t));
    } else if (mw == MW_KAHAN) {
        __m128i nb = bf16_rne8(p);
        _mm_storeu_si128((__m128i *)w, nb);
        _mm_storeu_si128((__m128i *)(j->comp + i), bf16_rne8(_mm256_sub_ps(p, bf16x8(nb))));
    } else if (w16) {  /* none, fp16: rare, lane by lane */
        float t[8];
        _mm256_storeu_ps(t, p);
        for (int k = 0; k < 8; k++)
            store_none1(j, i + k, t[k]);
    } else {
        __m256i rw = _mm256_and_si256(sr_bits8(j->idx0 + (uint32_t)i, j->k0 ^ W_KEY, j->k1),
                                      _mm256_set1_epi32(0xFFFF));
        _mm_storeu_si128((__m128i *)w, bf16_sr8(p, rw));
    }
}

/* update1 on the 8 elements at i with adam.c's parameter step (dense moments); amsgrad
 * (vx non-NULL): *vx holds the old max and gets the new one (lb_max_nan's NaN: all bits
 * set). */
LB2_INLINE void update8(const lb_job *j, int64_t i, int gdt, int mw, int w16, int odt,
                        __m256 *mo, __m256 *vo, __m256 *vx)
{
    __m256 p;
    moments8(j, i, gdt, mw, w16, &p, mo, vo);
    __m256 vv = *vo;
    if (vx) {
        vv = _mm256_or_ps(_mm256_max_ps(*vx, *vo), _mm256_cmp_ps(*vx, *vo, _CMP_UNORD_Q));
        *vx = vv;
    }
    store_param8(j, i, mw, w16, odt, tm_param_step8(&j->k, p, *mo, vv));
}

/* 8 codes (32-bit lanes, each <= 255) stored as bytes at dst */
LB2_INLINE void store_codes8(uint8_t *dst, __m256i c)
{
    __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packus_epi16(h, h));
}

/* enc_norm on 8 lanes whose a = |x| / scale has bits u at or above the smallest code */
LB2_INLINE __m256i enc_norm8(__m256i u, uint32_t ebias, int sr, __m256i r16, uint32_t top)
{
    __m256i t = _mm256_sub_epi32(u, _mm256_set1_epi32((int)(ebias << 23)));
    __m256i rnd = sr ? _mm256_or_si256(_mm256_slli_epi32(r16, 4), _mm256_set1_epi32(8))
                     : _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), _mm256_and_si256(
                           _mm256_srli_epi32(t, 20), _mm256_set1_epi32(1)));
    __m256i c = _mm256_srli_epi32(_mm256_add_epi32(t, rnd), 20);
    return _mm256_min_epu32(c, _mm256_set1_epi32((int)top));
}

/* enc_m and enc_v of the 8 elements at i (fp32 moments m, v; inverse scales ims, ivs; r:
 * their code_bits, exp_avg the low 16, exp_avg_sq the high 16). */
LB2_INLINE void encode8(const lb_job *j, int64_t i, __m256 m, __m256 v, float ims, float ivs,
                        int sr, __m256i r)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 axm = _mm256_andnot_ps(sign, m), axv = _mm256_andnot_ps(sign, v);
    __m256i um = _mm256_castps_si256(_mm256_mul_ps(axm, _mm256_set1_ps(ims)));
    __m256i uv = _mm256_castps_si256(_mm256_mul_ps(axv, _mm256_set1_ps(ivs)));
    /* every lane finite and at or above its smallest code (the bits of a magnitude, sign
     * clear, order as signed integers) */
    __m256 fin = _mm256_and_ps(_mm256_cmp_ps(axm, inf, _CMP_LT_OQ),
                               _mm256_cmp_ps(axv, inf, _CMP_LT_OQ));
    __m256i norm = _mm256_and_si256(
        _mm256_cmpgt_epi32(um, _mm256_set1_epi32((int)(((M_EBIAS + 1) << 23) - 1))),
        _mm256_cmpgt_epi32(uv, _mm256_set1_epi32((int)(((V_EBIAS + 1) << 23) - 1))));
    if (_mm256_movemask_ps(_mm256_and_ps(fin, _mm256_castsi256_ps(norm))) == 0xFF) {
        __m256i r16m = sr ? _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)) : r;
        __m256i r16v = sr ? _mm256_srli_epi32(r, 16) : r;
        __m256i cm = enc_norm8(um, M_EBIAS, sr, r16m, 0x7F);
        __m256i cv = enc_norm8(uv, V_EBIAS, sr, r16v, 0xFF);
        /* the code is >= 8 here, so a negative x takes the sign bit */
        cm = _mm256_or_si256(cm, _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_LT_OQ)),
            _mm256_set1_epi32(0x80)));
        store_codes8(j->m + i, cm);
        store_codes8(j->v + i, cv);
        return;
    }
    float tm[8], tv[8];
    uint32_t tr[8];
    _mm256_storeu_ps(tm, m);
    _mm256_storeu_ps(tv, v);
    _mm256_storeu_si256((__m256i *)tr, r);
    for (int k = 0; k < 8; k++) {
        j->m[i + k] = enc_m(tm[k], ims, sr, tr[k] & 0xFFFFu);
        j->v[i + k] = enc_v(tv[k], ivs, sr, tr[k] >> 16);
    }
}

/* encode8 on 8 elements of a block that lb2_scale() cleared, as encode16_fast does it
 * (see there): integer adds on the moments' bits, no multiply, no per-lane tests. */
LB2_INLINE void encode8_fast(const lb_job *j, int64_t i, __m256 m, __m256 v, uint32_t cm_add,
                             uint32_t cv_add, int sr, __m256i r)
{
    __m256i um = _mm256_castps_si256(m), uv = _mm256_castps_si256(v), rm, rv;
    if (sr) {
        const __m256i mask = _mm256_set1_epi32(0xFFFF0);
        rm = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(r, 4), mask),
                             _mm256_set1_epi32((int)cm_add));
        rv = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(r, 12), mask),
                             _mm256_set1_epi32((int)cv_add));
    } else {
        const __m256i one = _mm256_set1_epi32(1);
        rm = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(um, 20), one),
                              _mm256_set1_epi32((int)cm_add));
        rv = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(uv, 20), one),
                              _mm256_set1_epi32((int)cv_add));
    }
    __m256i sm = _mm256_add_epi32(um, rm), sv = _mm256_add_epi32(uv, rv);
    __m256i cm = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32(sm, 20), _mm256_set1_epi32(0x7F)),
        _mm256_and_si256(_mm256_srli_epi32(sm, 24), _mm256_set1_epi32(0x80)));
    store_codes8(j->m + i, cm);
    store_codes8(j->v + i, _mm256_srli_epi32(sv, 20));
}

/* The largest finite magnitude among n floats (a block with NaN or infinity) */
static inline float lb2_finite_max(const float *x, int n)
{
    float am = 0.0f;
    for (int k = 0; k < n; k++) {
        float a = fabsf(x[k]);
        if (a < INFINITY && a > am)
            am = a;
    }
    return am;
}

/* moment_scale with the block's largest and smallest magnitude bits already reduced */
static inline int lb2_scale(uint32_t hi, uint32_t lo, const float *x, int n, float lowest,
                            uint32_t minexp, int sr, float *scale, float *inv, uint32_t *add)
{
    int finite = hi < 0x7F800000u;
    block_scale(finite ? f32_from_bits(hi) : lb2_finite_max(x, n), scale, inv);
    uint32_t sb = f32_bits(*scale);
    *add = (sr ? 8u : 0x7FFFFu) - (sb - (minexp << 23));
    return finite && *inv > 0.0f && f32_from_bits(lo) * *inv >= lowest &&
           f32_from_bits(hi) * *inv <= Q_TOP && (sb >> 23) >= minexp;
}

LB2_INLINE uint32_t hmax8u(__m256i a)
{
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(x);
}

LB2_INLINE uint32_t hmin8u(__m256i a)
{
    __m128i x = _mm_min_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(x);
}

/* code_bits from the Weyl step x of 8 elements */
LB2_INLINE __m256i code_mix8(__m256i x, uint32_t k1)
{
    return _mm256_or_si256(_mm256_srli_epi32(x, 16),
                           _mm256_and_si256(_mm256_add_epi32(x, _mm256_set1_epi32((int)k1)),
                                            _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* The lines LB_PF elements ahead (as prefetch16: the hardware prefetcher stops at each
 * 4 KiB page), one prefetch per 64-byte line of each array. */
LB2_INLINE void prefetch8(const lb_job *j, int64_t i, int gdt, int mw)
{
    if (i & 15)
        return;
    _mm_prefetch((const char *)j->g + (i + LB_PF) * (gdt == LB_F32 ? 4 : 2), _MM_HINT_T0);
    _mm_prefetch((const char *)j->p + (i + LB_PF) * (mw == MW_FP32 ? 4 : 2), _MM_HINT_T0);
    if (mw == MW_KAHAN)
        _mm_prefetch((const char *)(j->comp + i + LB_PF), _MM_HINT_T0);
    if (!(i & 63)) {
        _mm_prefetch((const char *)(j->m + i + LB_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(j->v + i + LB_PF), _MM_HINT_T0);
    }
}

/* block_scalar's result on the blocks of [begin, end), 8 elements at a time. Pass 1 keeps
 * each moment's largest and smallest magnitude bits (range_add's rule: exp_avg_sq's bits
 * as they are, so a negative one counts as non-finite), so pass 2 codes nearly every block
 * with encode8_fast. Unlike range512, the two passes are not interleaved: with 16 vector
 * registers the interleaved loop spilled and ran 10-25% slower on the Zen 1 host, and with
 * the one-division step and the block-level decode no faster than this one. Instead the
 * work is balanced between them: the random bits move to pass 1 (they depend on no value;
 * with sr_bits' two multiplies then, 32M elements on the Zen 1 host, 2 threads: 2.03 ->
 * 1.86 ns/param), and the parameter step to pass 2, where the codes' integer arithmetic
 * runs while the divider works (pass 1 keeps the weights the step starts from in tp; the
 * same host, alternated in one process: 0.92-0.94x the time with stochastic rounding, no
 * change with nearest). The divider serves the square root and the division, and with
 * both in pass 2 it bounded that pass while pass 1 left it idle: the square root (the
 * step's denominator, kept in td) is taken in pass 1 and the division in pass 2 (the same
 * host: 0.93x the time with either rounding; the division in pass 1 too: 0.99x). Bit for
 * bit the same either way. */
LB2_INLINE void range256(const lb_job *jin, int64_t begin, int64_t end, int gdt, int mw, int w16,
                         int odt, int sr)
{
    lb_job c = *jin;  /* a local whose address never escapes: fields stay in registers */
    const lb_job *j = &c;
    float tm[QB] __attribute__((aligned(32))), tv[QB] __attribute__((aligned(32)));
    float tp[QB] __attribute__((aligned(32)));     /* the weights the step starts from */
    float td[QB] __attribute__((aligned(32)));     /* the step's denominator (denom_q8) */
    uint32_t tr[QB] __attribute__((aligned(32)));  /* the block's random bits */
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i step = _mm256_set1_epi32((int)(8u * SR_W));
    for (int64_t b = begin; b < end; b += QB) {
        int len = (int)(end - b < QB ? end - b : QB), full = len & ~7;
        int64_t blk = b / QB;
        float ms = j->ms[blk], vs = j->vs[blk];
        __m256i mmax = _mm256_setzero_si256(), vmax = mmax;
        __m256i mmin = _mm256_set1_epi32(-1), vmin = mmin;
        __m256i x = sr ? sr_weyl8(j->idx0 + (uint32_t)b, j->k0) : _mm256_setzero_si256();
        __m256i vbias;
        int dfast = len == QB && block_decodes_fast8(j, b, vs, &vbias);
#define LB2_PASS1(DECODE)                                                              \
        for (int k = 0; k < full; k += 8) {                                            \
            __m256 m, v;                                                               \
            if (b + k + LB_PF < end)                                                   \
                prefetch8(j, b + k, gdt, mw);                                          \
            if (sr) {                                                                  \
                _mm256_store_si256((__m256i *)(tr + k), code_mix8(x, j->k1));          \
                x = _mm256_add_epi32(x, step);                                         \
            }                                                                          \
            DECODE;                                                                    \
            __m256 p;                                                                  \
            moments8(j, b + k, gdt, mw, w16, &p, &m, &v);                              \
            _mm256_store_ps(tp + k, p);                                                \
            _mm256_store_ps(tm + k, m);                                                \
            _mm256_store_ps(tv + k, v);                                                \
            _mm256_store_ps(td + k, denom_q8(j, v));                                   \
            __m256i am = _mm256_and_si256(_mm256_castps_si256(m), absmask);            \
            __m256i av = _mm256_castps_si256(v);                                       \
            mmax = _mm256_max_epu32(mmax, am);                                         \
            mmin = _mm256_min_epu32(mmin, am);                                         \
            vmax = _mm256_max_epu32(vmax, av);                                         \
            vmin = _mm256_min_epu32(vmin, av);                                         \
        }
        if (dfast) {
            LB2_PASS1(dec8_fast(j, b + k, ms, vbias, &m, &v))
        } else {
            LB2_PASS1(dec8(j, b + k, ms, vs, &m, &v))
        }
#undef LB2_PASS1
        uint32_t mhi = hmax8u(mmax), mlo = hmin8u(mmin), vhi = hmax8u(vmax), vlo = hmin8u(vmin);
        for (int k = full; k < len; k++) {
            float m = dec_m(j->m[b + k], ms), v = dec_v(j->v[b + k], vs);
            update1(j, b + k, &m, &v);
            tm[k] = m;
            tv[k] = v;
            uint32_t am = f32_bits(m) & 0x7FFFFFFFu, av = f32_bits(v);
            mhi = am > mhi ? am : mhi;
            mlo = am < mlo ? am : mlo;
            vhi = av > vhi ? av : vhi;
            vlo = av < vlo ? av : vlo;
        }
        float ims, ivs;
        uint32_t madd, vadd;
        int fast = lb2_scale(mhi, mlo, tm, len, 0x1p-14f, 127u - M_EBIAS, sr, &ms, &ims, &madd);
        fast &= lb2_scale(vhi, vlo, tv, len, 0x1p-30f, 127u - V_EBIAS, sr, &vs, &ivs, &vadd);
        j->ms[blk] = ms;
        j->vs[blk] = vs;
        for (int k = 0; k < full; k += 8) {
            __m256i r = sr ? _mm256_load_si256((const __m256i *)(tr + k))
                           : _mm256_setzero_si256();
            __m256 m = _mm256_load_ps(tm + k), v = _mm256_load_ps(tv + k);
            store_param8(j, b + k, mw, w16, odt,
                         param_step_q8(j, _mm256_load_ps(tp + k), m,
                                       _mm256_load_ps(td + k)));
            if (fast)
                encode8_fast(j, b + k, m, v, madd, vadd, sr, r);
            else
                encode8(j, b + k, m, v, ims, ivs, sr, r);
        }
        for (int k = full; k < len; k++) {
            int64_t i = b + k;
            uint32_t r = sr ? code_bits(j->idx0 + (uint32_t)i, j->k0, j->k1) : 0u;
            j->m[i] = enc_m(tm[k], ims, sr, r & 0xFFFFu);
            j->v[i] = enc_v(tv[k], ivs, sr, r >> 16);
        }
    }
}

/* dense_scalar's result on [begin, end), 8 elements at a time (the last few: dense_scalar) */
LB2_INLINE void dense256(const lb_job *jin, int64_t begin, int64_t end, int gdt, int mw, int w16,
                         int odt, int mf, int sr)
{
    lb_job c = *jin;
    const lb_job *j = &c;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 m, v, vx = _mm256_setzero_ps();
        if (mf == MF_F32) {
            m = _mm256_loadu_ps((const float *)j->m + i);
            v = _mm256_loadu_ps((const float *)j->v + i);
            if (j->vmax)
                vx = _mm256_loadu_ps((const float *)j->vmax + i);
        } else {
            m = bf16x8(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->m + i)));
            v = bf16x8(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->v + i)));
            if (j->vmax)
                vx = bf16x8(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->vmax + i)));
        }
        update8(j, i, gdt, mw, w16, odt, &m, &v, j->vmax ? &vx : NULL);
        if (mf == MF_F32) {
            _mm256_storeu_ps((float *)j->m + i, m);
            _mm256_storeu_ps((float *)j->v + i, v);
            if (j->vmax)
                _mm256_storeu_ps((float *)j->vmax + i, vx);
            continue;
        }
        __m128i hm, hv, hx = _mm_setzero_si128();
        if (sr) {
            __m256i r = sr_bits8(j->idx0 + (uint32_t)i, j->k0, j->k1);
            __m256i rv = _mm256_srli_epi32(r, 16);
            hm = bf16_sr8(m, _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)));
            hv = bf16_sr8(v, rv);
            if (j->vmax)
                hx = bf16_sr8(vx, rv);
        } else {
            hm = bf16_rne8(m);
            hv = bf16_rne8(v);
            if (j->vmax)
                hx = bf16_rne8(vx);
        }
        _mm_storeu_si128((__m128i *)((uint16_t *)j->m + i), hm);
        _mm_storeu_si128((__m128i *)((uint16_t *)j->v + i), hv);
        if (j->vmax)
            _mm_storeu_si128((__m128i *)((uint16_t *)j->vmax + i), hx);
    }
    if (i < end)
        dense_scalar(j, i, end);
}

/* One loop per (weights, moments, rounding) with those as constants; the gradient's and
 * the copy's dtypes stay run-time branches, predicted the same way every element. */
#define LB2_NAME(MW, W, MF, SR) lb2_##MW##_##W##_##MF##_##SR
#define LB2_DEF(MW, W, MF, SR)                                                         \
    static TGT_LB2 __attribute__((noinline)) void                                     \
    LB2_NAME(MW, W, MF, SR)(const lb_job *j, int64_t begin, int64_t end)             \
    {                                                                                  \
        int odt = j->out ? j->out_dtype : -1;                                          \
        if (MF == MF_INT8)                                                             \
            range256(j, begin, end, j->g_dtype, MW, W, odt, SR);                       \
        else                                                                           \
            dense256(j, begin, end, j->g_dtype, MW, W, odt, MF, SR);                   \
    }
#define LB2_DEF_MF(MW, W)                                                              \
    LB2_DEF(MW, W, MF_F32, 0) LB2_DEF(MW, W, MF_BF16, 1) LB2_DEF(MW, W, MF_BF16, 0)    \
    LB2_DEF(MW, W, MF_INT8, 1) LB2_DEF(MW, W, MF_INT8, 0)
LB2_DEF_MF(MW_FP32, 0)
LB2_DEF_MF(MW_KAHAN, 1)
LB2_DEF_MF(MW_KAHAN, 0)
LB2_DEF_MF(MW_NONE, 1)
LB2_DEF_MF(MW_NONE, 0)

#define LB2_SR(MW, W)                                                                  \
    do {                                                                               \
        if (j->mf == MF_F32)                                                           \
            LB2_NAME(MW, W, MF_F32, 0)(j, begin, end);                                 \
        else if (j->mf == MF_BF16 && j->sr)                                            \
            LB2_NAME(MW, W, MF_BF16, 1)(j, begin, end);                                \
        else if (j->mf == MF_BF16)                                                     \
            LB2_NAME(MW, W, MF_BF16, 0)(j, begin, end);                                \
        else if (j->sr)                                                                \
            LB2_NAME(MW, W, MF_INT8, 1)(j, begin, end);                                \
        else                                                                           \
            LB2_NAME(MW, W, MF_INT8, 0)(j, begin, end);                                \
    } while (0)

static void lowbit_avx2(const lb_job *j, int64_t begin, int64_t end)
{
    if (j->mw == MW_FP32)
        LB2_SR(MW_FP32, 0);
    else if (j->mw == MW_KAHAN && j->w16)
        LB2_SR(MW_KAHAN, 1);
    else if (j->mw == MW_KAHAN)
        LB2_SR(MW_KAHAN, 0);
    else if (j->w16)
        LB2_SR(MW_NONE, 1);
    else
        LB2_SR(MW_NONE, 0);
}
#endif /* TM_X86 */

static void lowbit_scalar(const lb_job *j, int64_t begin, int64_t end)
{
    lb_job c = *j;
    if (c.mf != MF_INT8) {
        dense_scalar(&c, begin, end);
        return;
    }
    for (int64_t b = begin; b < end; b += QB)
        block_scalar(&c, b, (int)(end - b < QB ? end - b : QB));
}

/* -- threads and checksums ---------------------------------------------------------- */

typedef void (*lb_fn)(const lb_job *, int64_t, int64_t);

typedef struct {
    const lb_job *job;
    lb_fn fn;
    int64_t n;
    int64_t next;         /* next chunk (atomic) */
    int crc_mask;
    uint32_t *chunk_crcs; /* LB_NARRAYS per LB_CHUNK piece */
    int64_t chunk;        /* elements a chunk: a multiple of LB_CHUNK */
} lb_task;

static size_t arr_elem(const lb_job *j, int a)
{
    static const size_t sz[LB_NARRAYS] = {0, 1, 4, 1, 4, 2};
    if (a == 0)
        return j->mw == MW_FP32 ? 4 : 2;
    if ((a == 1 || a == 3) && j->mf != MF_INT8)
        return j->mf == MF_F32 ? 4 : 2;
    return sz[a];
}

static const char *arr_base(const lb_job *j, int a)
{
    switch (a) {
    case 0: return (const char *)j->p;
    case 1: return (const char *)j->m;
    case 2: return (const char *)j->ms;
    case 3: return (const char *)j->v;
    case 4: return (const char *)j->vs;
    default: return (const char *)j->comp;
    }
}

/* Elements [b, e) of array a: blocks for the scale arrays. */
static void arr_range(int a, int64_t b, int64_t e, int64_t *lo, int64_t *hi)
{
    if (a == 2 || a == 4) {
        *lo = b / QB;
        *hi = (e + QB - 1) / QB;
    } else {
        *lo = b;
        *hi = e;
    }
}

static void *run_chunks(void *arg)
{
    lb_task *t = arg;
    int64_t nchunks = (t->n + t->chunk - 1) / t->chunk;
    for (;;) {
        int64_t k = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (k >= nchunks)
            return NULL;
        int64_t cb = k * t->chunk, ce = cb + t->chunk < t->n ? cb + t->chunk : t->n;
        if (!t->crc_mask) {
            t->fn(t->job, cb, ce);
            continue;
        }
        /* piece by piece, each hashed right after its update, while it is in cache */
        for (int64_t b = cb; b < ce; b += LB_CHUNK) {
            int64_t e = b + LB_CHUNK < ce ? b + LB_CHUNK : ce;
            t->fn(t->job, b, e);
            for (int a = 0; a < LB_NARRAYS; a++) {
                if (!(t->crc_mask & (1 << a)))
                    continue;
                int64_t lo, hi;
                arr_range(a, b, e, &lo, &hi);
                size_t sz = arr_elem(t->job, a);
                t->chunk_crcs[LB_NARRAYS * (b / LB_CHUNK) + a] =
                    tm_crc32c(0, arr_base(t->job, a) + lo * sz, (size_t)(hi - lo) * sz);
            }
        }
    }
}

int tm_adam_lowbit_step(void *p, int master_mode, int weight_dtype, uint16_t *comp,
                        int moment_dtype,
                        void *exp_avg, float *exp_avg_scale, void *exp_avg_sq,
                        float *exp_avg_sq_scale, void *max_exp_avg_sq,
                        const void *grad, int grad_dtype, void *out, int out_dtype, int64_t n,
                        double lr, double beta1, double beta2, double eps,
                        double weight_decay, double step, int maximize, int decoupled,
                        int stochastic, uint64_t seed, uint64_t index0, int nthreads,
                        int crc_mask, uint32_t *crcs)
{
    if (n < 0 || grad_dtype < LB_F32 || grad_dtype > LB_F16 || master_mode < MW_FP32 ||
        master_mode > MW_NONE || moment_dtype < MF_INT8 || moment_dtype > MF_BF16 ||
        (master_mode == MW_FP32 ? weight_dtype != LB_F32
                                : weight_dtype != LB_BF16 && weight_dtype != LB_F16) ||
        crc_mask < 0 || crc_mask >= (1 << LB_NARRAYS) || (crc_mask && !crcs))
        return -EINVAL;
    /* dense moments have no scales; int8 codes no max_exp_avg_sq */
    if (moment_dtype != MF_INT8 &&
        (exp_avg_scale || exp_avg_sq_scale || (crc_mask & (CRC_MS | CRC_VS))))
        return -EINVAL;
    if (moment_dtype == MF_INT8 && max_exp_avg_sq)
        return -EINVAL;
    if (out && (master_mode != MW_FP32 || (out_dtype != LB_BF16 && out_dtype != LB_F16)))
        return -EINVAL;
    /* The random bits hash 32 bits of stream index: a call stays in one window. */
    if ((index0 & 0xFFFFFFFFu) + (uint64_t)n > ((uint64_t)1 << 32))
        return -ERANGE;
    for (int a = 0; a < LB_NARRAYS; a++)
        if (crc_mask & (1 << a))
            crcs[a] = 0;
    if (n == 0)
        return 0;
    if (!p || !exp_avg || !exp_avg_sq || !grad ||
        (moment_dtype == MF_INT8 && (!exp_avg_scale || !exp_avg_sq_scale)) ||
        (master_mode == MW_KAHAN) != (comp != NULL) || ((crc_mask & CRC_COMP) && !comp))
        return -EINVAL;

    uint64_t key = splitmix64(seed ^ splitmix64(index0 >> 32));
    lb_job j = {
        .p = p, .comp = comp, .m = exp_avg, .v = exp_avg_sq, .ms = exp_avg_scale,
        .vs = exp_avg_sq_scale, .g = grad, .out = out, .g_dtype = grad_dtype,
        .out_dtype = out_dtype, .mw = master_mode, .sr = !!stochastic, .mf = moment_dtype,
        .w16 = weight_dtype == LB_F16, .vmax = max_exp_avg_sq,
        .idx0 = (uint32_t)index0, .k0 = (uint32_t)key, .k1 = (uint32_t)(key >> 32),
        .k = tm_adam_coef_make(lr, beta1, beta2, eps, weight_decay, step, maximize, decoupled),
        .nssq = (float)(-(lr / (1.0 - pow(beta1, step))) * sqrt(1.0 - pow(beta2, step))),
        .epsq = (float)(eps * sqrt(1.0 - pow(beta2, step))),
    };
    lb_fn fn = lowbit_scalar;
#if TM_X86
    int isa = tm_adam_get_isa();
    if (isa == 2)
        fn = lowbit_avx512;
    else if (isa == 1)
        fn = lowbit_avx2;
#endif
    int64_t nchunks = (n + LB_CHUNK - 1) / LB_CHUNK;
    uint32_t *chunk_crcs = NULL;
    if (crc_mask) {
        chunk_crcs = malloc(sizeof(uint32_t) * LB_NARRAYS * (size_t)nchunks);
        if (!chunk_crcs)
            return -ENOMEM;
    }
    int parts = 1;
    if (n >= LB_PAR_MIN && nthreads > 1)
        parts = nthreads < nchunks ? nthreads : (int)nchunks;
    if (parts > LB_MAX_THREADS)
        parts = LB_MAX_THREADS;
    /* Long chunks (parallel.h): the int8 pass over 100M elements on two threads took
     * 0.164-0.167 ns/param with chunks of 1M elements against 0.189-0.227 with 64K ones
     * handed out in turn (this VM, alternated, 5 pairs of runs). */
    lb_task t = {&j, fn, n, 0, crc_mask, chunk_crcs,
                 tm_stream_chunk(n, parts, LB_CHUNK, LB_STREAM_CHUNK)};
    /* one task, its chunks taken in turn by every thread */
    tm_parallel_pieces(run_chunks, &t, 0, parts);
    if (crc_mask) {
        for (int a = 0; a < LB_NARRAYS; a++) {
            if (!(crc_mask & (1 << a)))
                continue;
            size_t sz = arr_elem(&j, a);
            uint32_t c = 0;
            for (int64_t k = 0; k < nchunks; k++) {
                int64_t b = k * LB_CHUNK, e = b + LB_CHUNK < n ? b + LB_CHUNK : n, lo, hi;
                arr_range(a, b, e, &lo, &hi);
                c = tm_crc32c_combine(c, chunk_crcs[LB_NARRAYS * k + a],
                                      (uint64_t)(hi - lo) * sz);
            }
            crcs[a] = c;
        }
        free(chunk_crcs);
    }
    return 0;
}
