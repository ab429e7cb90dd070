/* Numeric helpers shared by the native update kernels (adam.c, adam_lowbit.c):
 * exact fp32 <-> bf16/fp16 conversions with the rounding the kernels document, and
 * the counter-based random bits of stochastic rounding. Everything is static
 * inline: each kernel file gets its own copy, and the same arithmetic. */
#ifndef TM_NUMERIC_H
#define TM_NUMERIC_H

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

static inline uint32_t sr_bits(uint32_t idx, uint32_t k0, uint32_t k1)
{
    uint32_t x = idx * SR_W + k0;
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

static inline TGT_AVX512_H __attribute__((always_inline)) __m512i
sr_bits16(uint32_t idx, uint32_t k0, uint32_t k1)
{
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32((int)idx),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                   12, 13, 14, 15));
    x = _mm512_add_epi32(_mm512_mullo_epi32(x, _mm512_set1_epi32((int)SR_W)),
                         _mm512_set1_epi32((int)k0));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)SR_M1));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_xor_si512(x, _mm512_set1_epi32((int)k1));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)SR_M2));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

#undef TGT_AVX512_H
#endif /* TM_X86 */

#endif /* TM_NUMERIC_H */
