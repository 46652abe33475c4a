/* The blockwise 8-bit codec of quant8.py in C, shared by every 8-bit kernel (through blockwise.h): the maps' tables,
 * a block's codes decoded into its values (decode_block) and its values encoded into codes and an absmax
 * (store_block), in the in-memory layout (64 words per block, byte 4j+k holding element 64k+j). Decoding and encoding
 * have an AVX-512 version (decoding's byte-table lookups need VBMI) beside the plain one: same tables, same
 * arithmetic, same codes (the plain one is what other CPUs run; the tests compare the builds bit for bit). Compiled
 * with -ffp-contract=off, every operation rounds as torch's.
 *
 * maps (quant8.c_tables()): the signed and the unsigned map's decoded values (256 floats each, quant8.decode's),
 * then their encoding thresholds (7 decade midpoints and the top one, 8 floats each, quant8.THRESHOLDS).
 */
#ifndef HF_EFF_QUANT8_H
#define HF_EFF_QUANT8_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "native.h"

#define BLOCK 256
#define WORDS 64
#define EXP0 96 /* binade i of the encoding tables holds [2**(EXP0 + i - 127), twice that) */

/* One map's tables, built once per call from `maps` (build_map). */
typedef struct {
    float decoded[256];     /* the map's values */
    uint8_t planes[4][256]; /* byte b of each value, for byte-table lookups */
    float thresholds[8];    /* 7 decade midpoints, then the top one */
    int32_t base[32];       /* decade midpoints at or below binade i's bottom */
    float inner[32];        /* the one midpoint inside binade i (there is at most one: they are 10x apart), or inf */
    float n[16], inv_scale[16]; /* quant8.encode's n and inv_scale by count of midpoints passed; 8: the top */
    float n9[16], nm1[16];      /* n * (1 / 9) and n - 1, as code_of rounds them */
    int is_signed;
    uint8_t lo_index[4][64], hi_index[4][64]; /* decode_block's byte shuffles, per run k */
} map_t;

static const float INV_SCALE[7] = {1e7f, 1e6f, 1e5f, 1e4f, 1e3f, 1e2f, 1e1f}; /* 10**(7 - decade) */

static void build_map(map_t *t, const float *decoded, const float *thresholds, int is_signed) {
    const float first = is_signed ? 1.0f : 2.0f;
    memcpy(t->decoded, decoded, sizeof t->decoded);
    for (int c = 0; c < 256; c++) {
        uint32_t bits;
        memcpy(&bits, &decoded[c], 4);
        for (int b = 0; b < 4; b++)
            t->planes[b][c] = (uint8_t)(bits >> (8 * b));
    }
    memcpy(t->thresholds, thresholds, sizeof t->thresholds);
    for (int i = 0; i < 32; i++) {
        float lo = ldexpf(1.0f, EXP0 + i - 127), hi = 2.0f * lo;
        t->base[i] = 0;
        t->inner[i] = INFINITY;
        for (int d = 0; d < 7; d++) {
            t->base[i] += thresholds[d] <= lo;
            if (lo < thresholds[d] && thresholds[d] < hi)
                t->inner[i] = thresholds[d];
        }
    }
    t->n[0] = is_signed ? 0.0f : 1.0f;
    t->inv_scale[0] = 0.0f;
    for (int d = 0; d < 7; d++) {
        t->n[d + 1] = first * (float)(1 << d);
        t->inv_scale[d + 1] = INV_SCALE[d];
    }
    t->n[8] = first * 128.0f;
    t->inv_scale[8] = 0.0f;
    for (int c = 9; c < 16; c++)
        t->n[c] = t->inv_scale[c] = 0.0f;
    for (int c = 0; c < 16; c++) {
        t->n9[c] = t->n[c] * (float)(1.0 / 9.0);
        t->nm1[c] = t->n[c] - 1.0f;
    }
    t->is_signed = is_signed;
    for (int k = 0; k < 4; k++) /* byte 4j + b of run k's floats: byte b of element 64k + j's value */
        for (int j = 0; j < 16; j++)
            for (int b = 0; b < 4; b++) {
                t->lo_index[k][4 * j + b] = (uint8_t)((b == 1 ? 64 : 0) + 4 * j + k); /* bytes 0, 1: planes 0, 1 */
                t->hi_index[k][4 * j + b] = (uint8_t)((b == 3 ? 64 : 0) + 4 * j + k); /* bytes 2, 3: planes 2, 3 */
            }
}

/* quant8.block_scale: a block's absmax a, raised to fp32's smallest normal number where it is below it and positive
 * (1 / a would overflow to inf, and every value of the block encode as inf). A NaN stays NaN. */
static inline float block_scale(float a) { return a > 0.0f && a < 0x1p-126f ? 0x1p-126f : a; }

/* quant8.encode's last steps, given n and inv_scale: the code of x (a = |x| signed, x unsigned) */
static inline float code_of(float x, float a, float n, float inv_scale, int is_signed) {
    float k = floorf((a * inv_scale - 1.0f) * (n * (float)(1.0 / 9.0)));
    float nm1 = n - 1.0f;
    k = k < nm1 ? k : nm1; /* torch.minimum */
    k = k > 0.0f ? k : 0.0f; /* clamp_min */
    float J = n + k;
    return is_signed ? (x < 0.0f ? 127.0f - J : 127.0f + J) : J - 1.0f;
}

#if defined(__AVX512F__)
/* quant8.encode of 16 values x (normalized): their codes as int32. The decade's binade index is the exponent's low
 * 5 bits (binades EXP0..EXP0 + 31 = 96..127; |x| <= 1 tops at 127, smaller exponents are raised to 96 first, a NaN's
 * 255 lands on 31 as the min it replaces did). */
static inline __m512i encode16(__m512 v, const map_t *restrict t) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
    __m512 a = t->is_signed ? _mm512_castsi512_ps(bits) : v;
    __m512i idx = _mm512_srli_epi32(_mm512_max_epu32(bits, _mm512_set1_epi32(EXP0 << 23)), 23);
    __m512i count = _mm512_permutex2var_epi32(_mm512_loadu_si512(t->base), idx, _mm512_loadu_si512(t->base + 16));
    __mmask16 up = _mm512_cmp_ps_mask(
        a, _mm512_permutex2var_ps(_mm512_loadu_ps(t->inner), idx, _mm512_loadu_ps(t->inner + 16)), _CMP_GE_OQ);
    count = _mm512_mask_add_epi32(count, up, count, _mm512_set1_epi32(1));
    count = _mm512_mask_mov_epi32(count, _mm512_cmp_ps_mask(v, _mm512_set1_ps(t->thresholds[7]), _CMP_GT_OQ),
                                  _mm512_set1_epi32(8));
    __m512 n = _mm512_permutexvar_ps(count, _mm512_loadu_ps(t->n));
    __m512 inv_scale = _mm512_permutexvar_ps(count, _mm512_loadu_ps(t->inv_scale));
    __m512 k = _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps(a, inv_scale), one),
                             _mm512_permutexvar_ps(count, _mm512_loadu_ps(t->n9)));
    k = _mm512_roundscale_ps(k, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    k = _mm512_max_ps(_mm512_min_ps(k, _mm512_permutexvar_ps(count, _mm512_loadu_ps(t->nm1))), zero);
    __m512 J = _mm512_add_ps(n, k), code;
    if (t->is_signed) /* 127 + J, or 127 - J below zero: J (>= 0) takes x's sign bit where x < 0 */
        code = _mm512_add_ps(_mm512_set1_ps(127.0f), _mm512_castsi512_ps(_mm512_mask_or_epi32(
                                 _mm512_castps_si512(J), _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ),
                                 _mm512_castps_si512(J), _mm512_set1_epi32((int)0x80000000u))));
    else /* a positive value keeps the smallest positive code (see quant8.encode) */
        code = _mm512_mask_max_ps(_mm512_sub_ps(J, one), _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ),
                                  _mm512_sub_ps(J, one), one);
    return _mm512_cvttps_epi32(code);
}

/* The 16 in-memory words of 64 codes (int32 each): q[k] holds elements 64k + j, byte k of word j. */
static inline __m512i pack16(const __m512i q[4]) {
    const __m512i low = _mm512_set1_epi32(255);
    __m512i w = _mm512_ternarylogic_epi32(_mm512_and_si512(q[0], low),
                                          _mm512_slli_epi32(_mm512_and_si512(q[1], low), 8),
                                          _mm512_slli_epi32(_mm512_and_si512(q[2], low), 16), 0xFE); /* a | b | c */
    return _mm512_or_si512(w, _mm512_slli_epi32(q[3], 24));
}
#endif

/* quant8.encode of 256 values: the nearest code of each (x in [-1, 1] signed, [0, 1] unsigned), but never
 * the unsigned map's 0 for a positive x. The decade is the count of midpoints at or below |x|, as eager's chain of
 * comparisons finds it. (AVX-512: store_block encodes 16 at a time with encode16 itself.) */
static inline void encode_codes(const float *restrict x, const map_t *restrict t, uint32_t *restrict q) {
    for (int e = 0; e < BLOCK; e++) {
        float a = t->is_signed ? fabsf(x[e]) : x[e];
        int count = 0;
        for (int d = 0; d < 7; d++)
            count += a >= t->thresholds[d];
        count = x[e] > t->thresholds[7] ? 8 : count;
        float code = code_of(x[e], a, t->n[count], t->inv_scale[count], t->is_signed);
        /* unsigned: a positive value keeps the smallest positive code (see quant8.encode) */
        code = !t->is_signed && x[e] > 0.0f && code < 1.0f ? 1.0f : code;
        q[e] = (uint32_t)(int32_t)code;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define QUANT8_VBMI 1
/* The values of 16 in-memory words (64 codes): out[k] holds elements 64k + j of the words' block, j the words'
 * offsets. The 4 bytes of each value come from 4 byte tables (256 entries: two 128-byte lookups and a blend on the
 * code's top bit), then the bytes of element 64k + j (byte 4j + k of each plane) are gathered into one float. */
static inline void decode16(const uint32_t *restrict w, const map_t *restrict t, __m512 out[4]) {
    __m512i codes = _mm512_loadu_si512(w), bytes[4];
    __mmask64 high = _mm512_movepi8_mask(codes);
    for (int b = 0; b < 4; b++) {
        const uint8_t *plane = t->planes[b];
        bytes[b] = _mm512_mask_blend_epi8(
            high, _mm512_permutex2var_epi8(_mm512_loadu_si512(plane), codes, _mm512_loadu_si512(plane + 64)),
            _mm512_permutex2var_epi8(_mm512_loadu_si512(plane + 128), codes, _mm512_loadu_si512(plane + 192)));
    }
    for (int k = 0; k < 4; k++) {
        __m512i lo = _mm512_permutex2var_epi8(bytes[0], _mm512_loadu_si512(t->lo_index[k]), bytes[1]);
        __m512i hi = _mm512_permutex2var_epi8(bytes[2], _mm512_loadu_si512(t->hi_index[k]), bytes[3]);
        out[k] = _mm512_castsi512_ps(_mm512_mask_blend_epi8(0xCCCCCCCCCCCCCCCCull, lo, hi));
    }
}
#endif

/* The 256 map values of a block from its 64 in-memory words, before its absmax is applied (quant8.unpack's
 * decoded * scale: the caller multiplies in its own pass over the values, where the multiply costs nothing beside the
 * update's division and square root; here it was a quarter more time in decoding). */
static void decode_block(const uint32_t *restrict w, const map_t *restrict t, float *restrict out) {
#if defined(QUANT8_VBMI)
    for (int c = 0; c < WORDS / 16; c++) {
        __m512 runs[4];
        decode16(w + 16 * c, t, runs);
        for (int k = 0; k < 4; k++)
            _mm512_storeu_ps(out + WORDS * k + 16 * c, runs[k]);
    }
#else
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < WORDS; j++)
            out[WORDS * k + j] = t->decoded[(w[j] >> (8 * k)) & 255u];
#endif
}

/* Both maps' tables from quant8.c_tables(): tables[0] signed, tables[1] unsigned. */
static void quant8_maps(map_t tables[2], const float *maps) {
    build_map(&tables[0], maps, maps + 512, 1);
    build_map(&tables[1], maps + 256, maps + 520, 0);
}

/* The running absmax of a block's values, as the largest bit pattern of |x|: the same order for non-negative floats,
 * vectorizable (a reduction over integers), and a NaN (above inf) wins as in torch's amax. */
ALWAYS_INLINE uint32_t absmax_bits(uint32_t top, float x) {
    uint32_t a;
    memcpy(&a, &x, 4);
    a &= 0x7FFFFFFFu;
    return a > top ? a : top;
}

/* A block of values x whose absmax_bits are `top`, normalized by its absmax (quant8.pack's reciprocal) and encoded into
 * the block's 64 in-memory words; returns the absmax (quant8.block_scale's). x is overwritten. Neither this nor
 * decode_block is inlined into blockwise.h's block step: inlined, the fp32-weight 8-bit steps ran 3-30% slower on a
 * Zen 4 (how much varied from process to process); called, as fast as the hand-fused kernels they replaced. */
static float store_block(float *restrict x, uint32_t top, const map_t *restrict t, uint32_t *restrict w) {
    float a;
    memcpy(&a, &top, 4);
    a = block_scale(a);
    const float inv = 1.0f / (a > 0.0f ? a : 1.0f);
#if defined(__AVX512F__)
    for (int cw = 0; cw < WORDS / 16; cw++) {
        __m512i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = encode16(_mm512_mul_ps(_mm512_loadu_ps(x + WORDS * k + 16 * cw), _mm512_set1_ps(inv)), t);
        _mm512_storeu_si512(w + 16 * cw, pack16(q));
    }
#else
    for (int e = 0; e < BLOCK; e++)
        x[e] = x[e] * inv;
    uint32_t q[BLOCK];
    encode_codes(x, t, q);
    for (int j = 0; j < WORDS; j++)
        w[j] = (q[j] & 255u) | (q[WORDS + j] & 255u) << 8 | (q[2 * WORDS + j] & 255u) << 16 |
               (q[3 * WORDS + j] & 255u) << 24;
#endif
    return a;
}
#endif
