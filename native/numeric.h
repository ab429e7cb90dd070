/* Numeric helpers shared by the native update kernels (adam.c, adam_lowbit.c):
 * exact fp32 <-> bf16/fp16 conversions with the rounding the kernels document, and
 * the counter-based random bits of stochastic rounding. Everything is static
 * inline: each kernel file gets its own copy, and the same arithmetic. */
#ifndef TM_NUMERIC_H
#define TM_NUMERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define TM_X86 1
#include <immintrin.h>
#else
#define TM_X86 0
#endif

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

/* Stochastic rounding with 16 random bits r: truncation of x + r. The same NaN
 * rule as f32_to_bf16; infinities and bf16 values (low half zero) stay exact. No
 * carry leaves the 32 bits: the largest non-NaN pattern is 0xFF800000. */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + r) >> 16);
}

/* The random bits of one element: a keyed 32-bit integer hash of its index (a Weyl
 * step, then Wellons' lowbias32 finaliser with the second key word mixed in before
 * the last multiply). For a fixed key it is a bijection of the index, so no two
 * elements of a 2^32 window share their bits. exp_avg takes the low 16 bits, the
 * second moments the high 16: exp_avg_sq and max_exp_avg_sq share them, so
 * rounding keeps max_exp_avg_sq >= exp_avg_sq as the fp32 values had it. Only
 * 32-bit multiplies, which every path has (AVX2 and AVX-512F vpmulld). */
#define SR_W 0x9E3779B1u
#define SR_M1 0x7FEB352Du
#define SR_M2 0x846CA68Bu

/* The Weyl step of element idx: sr_bits mixes it, adam_lowbit.c's code_bits takes it as
 * it is (sr_weyl8 / sr_weyl16: 8 or 16 consecutive ones). */
static inline uint32_t sr_weyl(uint32_t idx, uint32_t k0)
{
    return idx * SR_W + k0;
}

static inline uint32_t sr_bits(uint32_t idx, uint32_t k0, uint32_t k1)
{
    uint32_t x = sr_weyl(idx, k0);
    x ^= x >> 16;
    x *= SR_M1;
    x ^= x >> 15;
    x ^= k1;
    x *= SR_M2;
    x ^= x >> 16;
    return x;
}

static inline uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
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


/* -- the Adam/AdamW arithmetic shared by adam.c and adam_lowbit.c -------------------
 *
 * Coefficients are formed in double and rounded to float once, as torch's fused CPU
 * Adam forms them; per element, in float (every operation correctly rounded):
 *
 *   g  = maximize ? -grad : grad
 *   Adam:  g = fma(p, wd, g)          AdamW: p = p * (1 - lr*wd)   (when wd != 0)
 *   m  = |1-beta1| < 0.5 ? fma(1-beta1, g - m, m) : fma((1-beta1) - 1, g - m, g)
 *   v  = fma((1-beta2) * g, g, v * beta2)
 *   p  = p + ((-lr/bc1) * m) / (sqrt(v') / sqrt(bc2) + eps)   (v' = v, or amsgrad's max)
 *
 * tm_moments* is the part up to v, tm_param_step* the last line; both kernels call
 * exactly these, on one element (scalar paths), 8 lanes (AVX2) or 16 (AVX-512). */
typedef struct tm_adam_coef {
    int maximize;
    int wd_mode;              /* 0 none, 1 L2 (Adam), 2 decoupled (AdamW) */
    int small;                /* |1 - beta1| < 0.5: lerp from m, else from g */
    /* 1: exp_avg_sq as torch's fused CPU kernel computes it in its scalar loop (the last
     * numel % 8 elements of a tensor it steps): v * beta2 fused onto the rounded
     * (1 - beta2) * g * g, where its vector loop, and ours everywhere else, round v * beta2
     * and fuse the second product (adam.c's tail_from says where; set there). */
    int torch_tail;
    float wd, decay, c1, c1m1, b2, c2, bc2s, eps, nss;
} tm_adam_coef;

static inline tm_adam_coef tm_adam_coef_make(double lr, double beta1, double beta2,
                                             double eps, double weight_decay, double step,
                                             int maximize, int decoupled)
{
    double bc1 = 1.0 - pow(beta1, step);
    double bc2 = 1.0 - pow(beta2, step);
    tm_adam_coef c = {
        .maximize = !!maximize,
        .wd_mode = weight_decay != 0.0 ? (decoupled ? 2 : 1) : 0,
        .wd = (float)weight_decay, .decay = (float)(1.0 - lr * weight_decay),
        .c1 = (float)(1.0 - beta1), .b2 = (float)beta2, .c2 = (float)(1.0 - beta2),
        .bc2s = (float)sqrt(bc2), .eps = (float)eps, .nss = (float)(-(lr / bc1)),
    };
    c.c1m1 = c.c1 - 1.0f;
    c.small = fabsf(c.c1) < 0.5f;
    return c;
}

static inline __attribute__((always_inline)) void
tm_moments1(const tm_adam_coef *c, float *g, float *p, float *m, float *v)
{
    if (c->maximize)
        *g = -*g;
    if (c->wd_mode == 1)
        *g = fmaf(*p, c->wd, *g);
    else if (c->wd_mode == 2)
        *p = *p * c->decay;
    float d = *g - *m;
    *m = c->small ? fmaf(c->c1, d, *m) : fmaf(c->c1m1, d, *g);
    float cg = c->c2 * *g;
    if (c->torch_tail) {
        *v = fmaf(*v, c->b2, cg * *g);
        return;
    }
    float vb = *v * c->b2;
    *v = fmaf(cg, *g, vb);
}

static inline __attribute__((always_inline)) float
tm_param_step1(const tm_adam_coef *c, float p, float m, float vv)
{
    float denom = sqrtf(vv) / c->bc2s + c->eps;
    return p + (c->nss * m) / denom;
}

#if TM_X86
/* AVX-512 forms of the helpers above, bit for bit the same. */
#define TM_TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define TGT_AVX512_H TM_TGT_AVX512  /* undefined again below */

static inline TGT_AVX512_H __attribute__((always_inline)) __m256i
pack_bf16_16(__m512i r, __m512 x)
{
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

static inline TGT_AVX512_H __attribute__((always_inline)) __m256i
bf16_rne16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return pack_bf16_16(_mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16), x);
}

/* sr_bits in two parts: the Weyl step idx * SR_W + k0 of the 16 indices idx .. idx+15,
 * and the rest. A loop over consecutive vectors adds 16 * SR_W to the Weyl step instead
 * of multiplying again (the same value mod 2^32). */
static inline TGT_AVX512_H __attribute__((always_inline)) __m512i
sr_weyl16(uint32_t idx, uint32_t k0)
{
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32((int)idx),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                   12, 13, 14, 15));
    return _mm512_add_epi32(_mm512_mullo_epi32(x, _mm512_set1_epi32((int)SR_W)),
                            _mm512_set1_epi32((int)k0));
}

static inline TGT_AVX512_H __attribute__((always_inline)) __m512i
sr_mix16(__m512i x, uint32_t k1)
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)SR_M1));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_xor_si512(x, _mm512_set1_epi32((int)k1));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)SR_M2));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline TGT_AVX512_H __attribute__((always_inline)) __m512i
sr_bits16(uint32_t idx, uint32_t k0, uint32_t k1)
{
    return sr_mix16(sr_weyl16(idx, k0), k1);
}


static inline TGT_AVX512_H __attribute__((always_inline)) void
tm_moments16(const tm_adam_coef *c, __m512 *g, __m512 *p, __m512 *m, __m512 *v)
{
    if (c->maximize)
        *g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(*g),
                                                  _mm512_set1_epi32((int)0x80000000u)));
    if (c->wd_mode == 1)
        *g = _mm512_fmadd_ps(*p, _mm512_set1_ps(c->wd), *g);
    else if (c->wd_mode == 2)
        *p = _mm512_mul_ps(*p, _mm512_set1_ps(c->decay));
    __m512 d = _mm512_sub_ps(*g, *m);
    *m = c->small ? _mm512_fmadd_ps(_mm512_set1_ps(c->c1), d, *m)
                  : _mm512_fmadd_ps(_mm512_set1_ps(c->c1m1), d, *g);
    __m512 cg = _mm512_mul_ps(_mm512_set1_ps(c->c2), *g);
    __m512 vb = _mm512_mul_ps(*v, _mm512_set1_ps(c->b2));
    *v = _mm512_fmadd_ps(cg, *g, vb);
}

static inline TGT_AVX512_H __attribute__((always_inline)) __m512
tm_param_step16(const tm_adam_coef *c, __m512 p, __m512 m, __m512 vv)
{
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), _mm512_set1_ps(c->bc2s)),
                                 _mm512_set1_ps(c->eps));
    return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->nss), m), denom));
}

#undef TGT_AVX512_H

/* AVX2 forms (8 lanes) of the same helpers, for adam.c's and adam_lowbit.c's AVX2 paths. */
#define TM_TGT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TM_AVX2_INLINE static inline TM_TGT_AVX2 __attribute__((always_inline))

/* 8 bf16 widened to fp32 (exact) */
TM_AVX2_INLINE __m256 bf16x8(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 32-bit results (each < 2^16) packed to 8 uint16 with NaN lanes of x set to 0x7FC0. */
TM_AVX2_INLINE __m128i pack_bf16_8(__m256i r, __m256 x)
{
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* f32_to_bf16 on 8 lanes */
TM_AVX2_INLINE __m128i bf16_rne8(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return pack_bf16_8(_mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16), x);
}

/* f32_to_bf16_sr on 8 lanes (r: 16 random bits per lane) */
TM_AVX2_INLINE __m128i bf16_sr8(__m256 x, __m256i r)
{
    return pack_bf16_8(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16), x);
}

/* sr_bits in two parts, as sr_weyl16 / sr_mix16: a loop over consecutive groups adds
 * 8 * SR_W to the Weyl step instead of multiplying again. */
TM_AVX2_INLINE __m256i sr_weyl8(uint32_t idx, uint32_t k0)
{
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32((int)idx),
                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_add_epi32(_mm256_mullo_epi32(x, _mm256_set1_epi32((int)SR_W)),
                            _mm256_set1_epi32((int)k0));
}

TM_AVX2_INLINE __m256i sr_mix8(__m256i x, uint32_t k1)
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)SR_M1));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_xor_si256(x, _mm256_set1_epi32((int)k1));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)SR_M2));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* tm_moments1 / tm_param_step1 on 8 lanes (the vector loops' arithmetic: no torch_tail) */
TM_AVX2_INLINE void tm_moments8(const tm_adam_coef *c, __m256 *g, __m256 *p, __m256 *m,
                                __m256 *v)
{
    if (c->maximize)
        *g = _mm256_xor_ps(*g, _mm256_set1_ps(-0.0f));
    if (c->wd_mode == 1)
        *g = _mm256_fmadd_ps(*p, _mm256_set1_ps(c->wd), *g);
    else if (c->wd_mode == 2)
        *p = _mm256_mul_ps(*p, _mm256_set1_ps(c->decay));
    __m256 d = _mm256_sub_ps(*g, *m);
    *m = c->small ? _mm256_fmadd_ps(_mm256_set1_ps(c->c1), d, *m)
                  : _mm256_fmadd_ps(_mm256_set1_ps(c->c1m1), d, *g);
    __m256 cg = _mm256_mul_ps(_mm256_set1_ps(c->c2), *g);
    __m256 vb = _mm256_mul_ps(*v, _mm256_set1_ps(c->b2));
    *v = _mm256_fmadd_ps(cg, *g, vb);
}

TM_AVX2_INLINE __m256 tm_param_step8(const tm_adam_coef *c, __m256 p, __m256 m, __m256 vv)
{
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), _mm256_set1_ps(c->bc2s)),
                                 _mm256_set1_ps(c->eps));
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->nss), m), denom));
}

/* sr_bits for the 8 indices idx .. idx+7 (mod 2^32) */
TM_AVX2_INLINE __m256i sr_bits8(uint32_t idx, uint32_t k0, uint32_t k1)
{
    return sr_mix8(sr_weyl8(idx, k0), k1);
}

#undef TM_AVX2_INLINE
#endif /* TM_X86 */

#endif /* TM_NUMERIC_H */
