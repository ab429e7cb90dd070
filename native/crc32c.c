/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the digest of swap records.
 *
 * Why CRC32C: the SSE4.2 crc32 instruction computes it at one 8-byte word per
 * cycle per dependency chain, and, unlike a hash such as XXH3, CRCs of pieces
 * can be combined (crc(a+b) from crc(a), crc(b) and len(b)). That lets the Adam
 * kernel hash each chunk it just wrote while it is in cache, on whatever thread
 * wrote it, and the caller assemble the record's CRC from the pieces.
 *
 * - tm_crc32c(crc, buf, len): continue `crc` (0 to start) over buf; the value is
 *   the standard CRC-32C (init and final xor ~0), crc32c("123456789") = E3069283.
 *   Picks the SSE4.2 path at run time (__builtin_cpu_supports), else a table.
 * - tm_crc32c_combine(crc1, crc2, len2): crc of a+b from crc(a), crc(b), len(b),
 *   as zlib's crc32_combine does it (multiply by x^(8*len2) mod P).
 * - tm_crc32c_threads(buf, len, nthreads): the same value, the buffer split into up
 *   to nthreads pieces hashed at once (tm_parallel_pieces: OpenMP's team from the main
 *   thread, else threads of the call) and combined.
 *
 * The hardware path runs three independent crc32 chains over three adjacent
 * blocks (the instruction's latency is 3 cycles, its throughput one per cycle)
 * and joins them by shifting the first two chains past the bytes after them:
 * a fixed shift by x^(8n) mod P is linear in the 32 CRC bits, so it is four
 * lookups in tables built once.
 *
 * Where the CPU has AVX-512 and VPCLMULQDQ, long buffers take a folding path
 * instead (tm_crc32c picks it): carry-less multiplication folds 256 bytes per
 * iteration into four 512-bit accumulators, so the loop is bound by loads, not
 * by the crc32 instruction's one word per cycle (the 3-way path reached half of
 * what one core reads from DRAM here, 12 of 25 GB/s, and records are hashed
 * straight from DRAM when read back). Its constants x^k mod P are computed at
 * start-up with multmodp, not copied from tables; the folded 128 bits are turned
 * back into a CRC register with two crc32 instructions.
 *
 * Where the CPU has PCLMULQDQ but not that (AVX2 hosts: AMD Zen 1/2, Intel before Ice
 * Lake), a 128-bit folding path (raw_fold128: four 16-byte accumulators, 64 bytes per
 * iteration) can beat the 3-way path: on Zen 1 the crc32 instruction issues one word
 * every three cycles, so three chains hash no faster than one (6 GB/s here, against 10
 * for the carry-less fold, both in L2); on Intel cores since Skylake the two are about
 * even. Which one tm_crc32c takes there is measured once at start-up (pick_path) over a
 * buffer in cache: both give the same value, so the choice moves only the speed. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "parallel.h"
#include "tiermem_native.h"

#if defined(__x86_64__)
#define TM_CRC_X86 1
#include <immintrin.h>
#include <nmmintrin.h>
#else
#define TM_CRC_X86 0
#endif

#define POLY 0x82F63B78u
#define LANE 4096                 /* bytes per chain in one 3-way round */
#define THREAD_MIN (4u << 20)     /* split across threads only pieces this big */

static uint32_t table[8][256];       /* slicing-by-8 tables of the portable path */
static uint32_t x2n[68];             /* x^(2^k) mod P, for combine (n < 2^64 bytes) */
static uint32_t shift1[4][256];      /* multiply by x^(8*LANE) mod P */
static uint32_t shift2[4][256];      /* multiply by x^(8*2*LANE) mod P */
static int use_hw;
static int use_fold;                 /* AVX-512F + VPCLMULQDQ + SSE4.2 */
static int use_clmul;                /* PCLMULQDQ + SSE4.2: raw_fold128 can run */
static int path;                     /* what tm_crc32c takes: pick_path */
#define FOLD_MIN 1024                /* shorter buffers: the 3-way path */
#define FOLD128_MIN 256              /* the same for raw_fold128 */
/* Folding constants, each x^e mod P as a 32-bit reflected value placed in the
 * upper half of a 64-bit lane (so a 64x64 carry-less product lines up, see
 * fold_consts). fold_loop: by 2048 bits (256 bytes); fold_end[j]: lane j of
 * the final 16 lanes moved by (15 - j) * 128 bits to the last lane. */
static uint64_t fold_loop[2];
static uint64_t fold_end[16][2];
/* raw_fold128's: by 512 bits (64 bytes), and lane j of four moved (3 - j) * 128 bits. */
static uint64_t fold128_loop[2];
static uint64_t fold128_end[3][2];
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* a * b mod P, reflected (bit 31 is x^0), as in zlib's multmodp. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(8n) mod P: n bytes of shift. */
static uint32_t x8nmodp(uint64_t n)
{
    uint32_t p = 1u << 31;  /* x^0 */
    int k = 3;              /* x2n[3] = x^8: one byte */
    while (n) {
        if (n & 1)
            p = multmodp(x2n[k], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* x^m mod P for a bit count m. */
static uint32_t xbitsmodp(uint64_t m)
{
    uint32_t p = 1u << 31;  /* x^0 */
    for (int k = 0; m; k++, m >>= 1)
        if (m & 1)
            p = multmodp(x2n[k], p);
    return p;
}

/* The pair that moves a 128-bit accumulator d bits (d >= 64) further down the
 * message. A register X holds H(x) x^64 + L(x): its low quadword is H, its high
 * one L (reflected: bit 0 is the highest power). A reflected 64x64 carry-less
 * product reads back, as a 128-bit reflected value, as x * A * B; so H times
 * x^(d+63) mod P and L times x^(d-1) mod P give H x^(d+64) + L x^d = X x^d,
 * modulo P, in at most 96 bits. */
static void fold_consts(uint64_t out[2], uint64_t d)
{
    out[0] = (uint64_t)xbitsmodp(d + 63) << 32;  /* multiplies H (low quadword) */
    out[1] = (uint64_t)xbitsmodp(d - 1) << 32;   /* multiplies L (high quadword) */
}

static void shift_table(uint32_t t[4][256], uint32_t op)
{
    for (int b = 0; b < 4; b++)
        for (uint32_t v = 0; v < 256; v++)
            t[b][v] = multmodp(op, v << (8 * b));
}

static inline uint32_t shift(uint32_t t[4][256], uint32_t c)
{
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

enum { PATH_TABLE, PATH_SSE42, PATH_CLMUL, PATH_FOLD };
static void pick_path(void);

static void init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            table[k][n] = (table[k - 1][n] >> 8) ^ table[0][table[k - 1][n] & 0xff];
    uint32_t p = 1u << 30;  /* x^1 */
    x2n[0] = p;
    for (int k = 1; k < 68; k++)
        x2n[k] = p = multmodp(p, p);
    shift_table(shift1, x8nmodp(LANE));
    shift_table(shift2, x8nmodp(2 * LANE));
#if TM_CRC_X86
    __builtin_cpu_init();
    use_hw = __builtin_cpu_supports("sse4.2");
    use_fold = use_hw && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("vpclmulqdq");
    use_clmul = use_hw && __builtin_cpu_supports("pclmul");
#endif
    fold_consts(fold_loop, 2048);
    for (int j = 0; j < 15; j++)
        fold_consts(fold_end[j], (uint64_t)(15 - j) * 128);
    fold_end[15][0] = fold_end[15][1] = 0;  /* the last lane stays where it is */
    fold_consts(fold128_loop, 512);
    for (int j = 0; j < 3; j++)
        fold_consts(fold128_end[j], (uint64_t)(3 - j) * 128);
    pick_path();
}

/* The raw register (no pre/post inversion) over buf, table-driven. */
static uint32_t raw_sw(uint32_t c, const unsigned char *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;  /* little-endian: the low 4 bytes take the register */
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^
            table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--)
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
    return c;
}

#if TM_CRC_X86
__attribute__((target("sse4.2")))
static uint32_t raw_hw(uint32_t c, const unsigned char *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8(c, *p++);
        len--;
    }
    uint64_t c0 = c;
    while (len >= 3 * LANE) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *a = p, *b = p + LANE, *d = p + 2 * LANE;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t wa, wb, wd;
            memcpy(&wa, a + i, 8);
            memcpy(&wb, b + i, 8);
            memcpy(&wd, d + i, 8);
            c0 = _mm_crc32_u64(c0, wa);
            c1 = _mm_crc32_u64(c1, wb);
            c2 = _mm_crc32_u64(c2, wd);
        }
        /* Register state after a|b|d: chain 0 moved past 2 lanes, chain 1 past one. */
        c0 = shift(shift2, (uint32_t)c0) ^ shift(shift1, (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * LANE;
        len -= 3 * LANE;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c0 = _mm_crc32_u64(c0, w);
        p += 8;
        len -= 8;
    }
    c = (uint32_t)c0;
    while (len--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

#if TM_CRC_X86
/* The folding path over len >= FOLD_MIN bytes (any alignment): returns the raw
 * register, like raw_hw. */
__attribute__((target("avx512f,vpclmulqdq,sse4.2")))
static uint32_t raw_fold(uint32_t c, const unsigned char *p, size_t len)
{
    const __m512i k = _mm512_broadcast_i32x4(
        _mm_set_epi64x((long long)fold_loop[1], (long long)fold_loop[0]));
    /* The starting register is the first 32 message bits' complement: xor it in. */
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(
        _mm_cvtsi32_si128((int)c)));
    __m512i a1 = _mm512_loadu_si512(p + 64);
    __m512i a2 = _mm512_loadu_si512(p + 128);
    __m512i a3 = _mm512_loadu_si512(p + 192);
    p += 256;
    len -= 256;
#define TM_FOLD(acc, src) \
    acc = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), \
                                    _mm512_clmulepi64_epi128(acc, k, 0x11), \
                                    _mm512_loadu_si512(src), 0x96)
    while (len >= 256) {
        TM_FOLD(a0, p);
        TM_FOLD(a1, p + 64);
        TM_FOLD(a2, p + 128);
        TM_FOLD(a3, p + 192);
        p += 256;
        len -= 256;
    }
#undef TM_FOLD
    /* Sixteen 128-bit lanes, in message order a0[0..3], a1[0..3], ...: move each
     * to the last one's place and add them up. */
    __m512i acc[4] = {a0, a1, a2, a3};
    __m512i sum = _mm512_setzero_si512();
    for (int r = 0; r < 3; r++) {
        const uint64_t *k0 = fold_end[4 * r], *k1 = fold_end[4 * r + 1],
                       *k2 = fold_end[4 * r + 2], *k3 = fold_end[4 * r + 3];
        __m512i kr = _mm512_set_epi64((long long)k3[1], (long long)k3[0],
                                      (long long)k2[1], (long long)k2[0],
                                      (long long)k1[1], (long long)k1[0],
                                      (long long)k0[1], (long long)k0[0]);
        sum = _mm512_ternarylogic_epi64(sum, _mm512_clmulepi64_epi128(acc[r], kr, 0x00),
                                        _mm512_clmulepi64_epi128(acc[r], kr, 0x11), 0x96);
    }
    {   /* a3: its last lane is not moved */
        const uint64_t *k0 = fold_end[12], *k1 = fold_end[13], *k2 = fold_end[14];
        __m512i kr = _mm512_set_epi64(0, 0, (long long)k2[1], (long long)k2[0],
                                      (long long)k1[1], (long long)k1[0],
                                      (long long)k0[1], (long long)k0[0]);
        __m512i moved = _mm512_xor_si512(_mm512_clmulepi64_epi128(acc[3], kr, 0x00),
                                         _mm512_clmulepi64_epi128(acc[3], kr, 0x11));
        moved = _mm512_mask_xor_epi64(moved, 0xC0, moved, acc[3]);  /* lane 3 as is */
        sum = _mm512_xor_si512(sum, moved);
    }
    __m128i x = _mm_xor_si128(
        _mm_xor_si128(_mm512_extracti32x4_epi32(sum, 0), _mm512_extracti32x4_epi32(sum, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(sum, 2), _mm512_extracti32x4_epi32(sum, 3)));
    /* X (128 bits, congruent to the message so far) into a CRC register: the crc32
     * instruction over X's two quadwords from a zero register gives X x^32 mod P. */
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(x, 1));
    return raw_hw((uint32_t)r, p, len);
}
#endif

#if TM_CRC_X86
/* The 128-bit folding path over len >= FOLD128_MIN bytes (any alignment): the same
 * scheme as raw_fold with one 16-byte lane per accumulator; returns the raw register. */
__attribute__((target("pclmul,sse4.2")))
static uint32_t raw_fold128(uint32_t c, const unsigned char *p, size_t len)
{
    const __m128i k = _mm_set_epi64x((long long)fold128_loop[1], (long long)fold128_loop[0]);
    __m128i a0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    __m128i a1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i a3 = _mm_loadu_si128((const __m128i *)(p + 48));
    p += 64;
    len -= 64;
#define TM_FOLD128(acc, src, kk) \
    acc = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, kk, 0x00), \
                                      _mm_clmulepi64_si128(acc, kk, 0x11)), (src))
    while (len >= 64) {
        TM_FOLD128(a0, _mm_loadu_si128((const __m128i *)p), k);
        TM_FOLD128(a1, _mm_loadu_si128((const __m128i *)(p + 16)), k);
        TM_FOLD128(a2, _mm_loadu_si128((const __m128i *)(p + 32)), k);
        TM_FOLD128(a3, _mm_loadu_si128((const __m128i *)(p + 48)), k);
        p += 64;
        len -= 64;
    }
    /* Lanes a0..a2 moved to a3's place and added to it. */
    __m128i k0 = _mm_set_epi64x((long long)fold128_end[0][1], (long long)fold128_end[0][0]);
    __m128i k1 = _mm_set_epi64x((long long)fold128_end[1][1], (long long)fold128_end[1][0]);
    __m128i k2 = _mm_set_epi64x((long long)fold128_end[2][1], (long long)fold128_end[2][0]);
    TM_FOLD128(a0, a3, k0);
    TM_FOLD128(a1, a0, k1);
    TM_FOLD128(a2, a1, k2);
#undef TM_FOLD128
    /* As in raw_fold: two crc32 instructions turn the 128 bits into the register. */
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a2));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(a2, 1));
    return raw_hw((uint32_t)r, p, len);
}
#endif

/* The standard CRC by one path; the tables and constants must be ready (init). */
static uint32_t crc_by(int which, uint32_t crc, const void *buf, size_t len)
{
    uint32_t c = ~crc;
#if TM_CRC_X86
    if (which == PATH_FOLD && len >= FOLD_MIN)
        return ~raw_fold(c, buf, len);
    if (which == PATH_CLMUL && len >= FOLD128_MIN)
        return ~raw_fold128(c, buf, len);
    if (which != PATH_TABLE)
        return ~raw_hw(c, buf, len);
#endif
    (void)which;
    return ~raw_sw(c, buf, len);
}

static uint32_t crc_with(int which, uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once, init);
    return crc_by(which, crc, buf, len);
}

#define PICK_BYTES (32u << 10)

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Seconds of the fastest of `reps` hashes of buf by `which` (warm: each rep reads the
 * same 32 KiB, in L1/L2 after the first). */
static double best_of(int which, const unsigned char *buf, int reps)
{
    double best = 1e30;
    volatile uint32_t sink = 0;
    for (int r = 0; r < reps; r++) {
        double t = seconds();
        sink ^= crc_by(which, 0, buf, PICK_BYTES);  /* inside init: no pthread_once */
        t = seconds() - t;
        if (t < best)
            best = t;
    }
    (void)sink;
    return best;
}

/* AVX-512 folding where it runs; else, where both run, whichever of the 3-way crc32 path
 * and the 128-bit fold hashes 32 KiB in cache faster here (a few tens of microseconds,
 * once: the two alternate so a clock ramp or a preemption hits both); else SSE4.2, else
 * the table. */
static void pick_path(void)
{
    path = use_fold ? PATH_FOLD : use_hw ? PATH_SSE42 : PATH_TABLE;
    if (use_fold || !use_clmul)
        return;
    static unsigned char buf[PICK_BYTES];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (unsigned char)(i * 2654435761u >> 24);
    double hw = 1e30, clmul = 1e30;
    for (int round = 0; round < 4; round++) {
        double a = best_of(PATH_SSE42, buf, 3), b = best_of(PATH_CLMUL, buf, 3);
        hw = a < hw ? a : hw;
        clmul = b < clmul ? b : clmul;
    }
    if (clmul < hw)
        path = PATH_CLMUL;
}

uint32_t tm_crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&init_once, init);
    return crc_with(path, crc, buf, len);
}

int tm_crc32c_path(void)
{
    pthread_once(&init_once, init);
    return path;
}

int tm_crc32c_clmul_supported(void)
{
    pthread_once(&init_once, init);
    return use_clmul;
}

uint32_t tm_crc32c_clmul(uint32_t crc, const void *buf, size_t len)
{
    /* Only where tm_crc32c_clmul_supported(); elsewhere the portable path answers. */
    return crc_with(tm_crc32c_clmul_supported() ? PATH_CLMUL : PATH_TABLE, crc, buf, len);
}

int tm_crc32c_fold_supported(void)
{
    pthread_once(&init_once, init);
    return use_fold;
}

uint32_t tm_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    return crc_with(PATH_TABLE, crc, buf, len);
}

int tm_crc32c_hw_supported(void)
{
    pthread_once(&init_once, init);
    return use_hw;
}

uint32_t tm_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    /* Only where tm_crc32c_hw_supported(); elsewhere the portable path answers. */
    return crc_with(tm_crc32c_hw_supported() ? PATH_SSE42 : PATH_TABLE, crc, buf, len);
}

uint32_t tm_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    pthread_once(&init_once, init);
    return multmodp(x8nmodp(len2), crc1) ^ crc2;
}

typedef struct {
    const unsigned char *p;
    size_t len;
    uint32_t crc;
} piece;

static void *hash_piece(void *arg)
{
    piece *pc = arg;
    pc->crc = tm_crc32c(0, pc->p, pc->len);
    return NULL;
}

#define MAX_PIECES 16

uint32_t tm_crc32c_threads(const void *buf, size_t len, int nthreads)
{
    int n = nthreads < 1 ? 1 : nthreads > MAX_PIECES ? MAX_PIECES : nthreads;
    if ((size_t)n > len / THREAD_MIN)
        n = (int)(len / THREAD_MIN);
    if (n <= 1)
        return tm_crc32c(0, buf, len);
    piece pcs[MAX_PIECES];
    size_t each = len / n / 64 * 64;
    for (int i = 0; i < n; i++) {
        pcs[i].p = (const unsigned char *)buf + (size_t)i * each;
        pcs[i].len = i == n - 1 ? len - (size_t)i * each : each;
    }
    /* the update passes' threads: OpenMP's team from the main thread, else threads of
     * this call (parallel.h) */
    tm_parallel_pieces(hash_piece, pcs, sizeof(piece), n);
    uint32_t crc = pcs[0].crc;
    for (int i = 1; i < n; i++)
        crc = tm_crc32c_combine(crc, pcs[i].crc, pcs[i].len);
    return crc;
}
