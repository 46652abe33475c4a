/* The blockwise 4-bit codec of quant4.py in C, for the 4-bit kernels: a block's codes decoded into 128 floats, 128
 * floats encoded into a block's codes, in quant4.py's in-memory layout (16 little-endian 32-bit words per block,
 * nibble k of word j holding element 16k + j). Self-contained and prefixed (q4_, Q4_), so that a kernel can include it
 * beside quant8.h. An AVX-512 version of each function sits beside the plain one: same operations, same codes (one
 * nibble plane of a block is one 16-float register, and a 16-entry table lookup one permute). Compiled with
 * -ffp-contract=off, every operation rounds as torch's.
 *
 * tables (quant4.c_tables()): the signed map (16 floats), then the signed encoder's 8 thresholds.
 */
#ifndef HF_EFF_QUANT4_H
#define HF_EFF_QUANT4_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define Q4_BLOCK 128
#define Q4_WORDS 16

typedef struct {
    float map[2][16];     /* [1]: the signed map; [0]: the unsigned map's roots (c + 1) / 16 */
    float thresholds[8];  /* the signed encoder's (quant4.THRESHOLDS) */
} q4_tables_t;

/* quant4.c_tables() into t. */
static void q4_tables(q4_tables_t *t, const float *tables) {
    memcpy(t->map[1], tables, 16 * sizeof(float));
    for (int c = 0; c < 16; c++)
        t->map[0][c] = (float)(c + 1) * 0.0625f;
    memcpy(t->thresholds, tables + 16, 8 * sizeof(float));
}

/* quant4.block_scale: the largest |x| (given as the largest bit pattern of |x|: NaN wins), raised to 2**-126 where
 * positive and below it. */
static inline float q4_block_scale(uint32_t bits) {
    float a;
    memcpy(&a, &bits, 4);
    return a > 0.0f && a < 0x1p-126f ? 0x1p-126f : a;
}

/* The largest bit pattern of |x| over a block. */
static inline uint32_t q4_absmax_bits(const float *restrict x) {
    uint32_t bits = 0;
    for (int e = 0; e < Q4_BLOCK; e++) {
        uint32_t a;
        memcpy(&a, &x[e], 4);
        a &= 0x7FFFFFFFu;
        bits = a > bits ? a : bits;
    }
    return bits;
}

/* The multiplier of a block's normalized values and what its decoded map values are multiplied by, from its scale a:
 * signed, fl(1 / a) and a; unsigned, 16 * fl(1 / sqrt(a)) (exact: a power of two; the codes of 16 * fl(x * fl(1/r))
 * and of fl(x * 16 fl(1/r)) agree, see quant4_triton.encode) and sqrt(a). A zero scale counts as 1. */
static inline void q4_factors(float a, int is_signed, float *inv, float *mul) {
    float s = is_signed ? a : sqrtf(a);
    *inv = 1.0f / (s > 0.0f ? s : 1.0f);
    if (!is_signed)
        *inv *= 16.0f;
    *mul = s;
}

/* The code of value x times inv (q4_factors): quant4.encode of the normalized value (signed) or root (unsigned). */
static inline uint32_t q4_code(float x, float inv, const q4_tables_t *restrict t, int is_signed) {
    if (is_signed) {
        float y = x * inv, a = fabsf(y);
        int n = 0;
        for (int i = 0; i < 8; i++)
            n += a >= t->thresholds[i];
        return (uint32_t)(y < 0.0f ? 7 - (n < 7 ? n : 7) : 7 + n);
    }
    float q = rintf(sqrtf(x) * inv); /* nearest, ties to even (the default rounding mode) */
    q = q > 1.0f ? q : 1.0f;          /* comparisons: a NaN takes level 1 */
    q = q < 16.0f ? q : 16.0f;
    return (uint32_t)q - 1u;
}

#if defined(__AVX512F__)
/* q4_code of 16 values. */
static inline __m512i q4_code16(__m512 x, __m512 inv, const q4_tables_t *restrict t, int is_signed) {
    if (is_signed) {
        __m512 y = _mm512_mul_ps(x, inv), a = _mm512_abs_ps(y);
        __m512i n = _mm512_setzero_si512(), one = _mm512_set1_epi32(1), seven = _mm512_set1_epi32(7);
        for (int i = 0; i < 8; i++)
            n = _mm512_mask_add_epi32(n, _mm512_cmp_ps_mask(a, _mm512_set1_ps(t->thresholds[i]), _CMP_GE_OQ), n, one);
        __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
        return _mm512_mask_sub_epi32(_mm512_add_epi32(seven, n), neg, seven, _mm512_min_epi32(n, seven));
    }
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sqrt_ps(x), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_max_ps(q, _mm512_set1_ps(1.0f));  /* maxps(q, 1): q > 1 ? q : 1, a NaN q giving 1 */
    q = _mm512_min_ps(q, _mm512_set1_ps(16.0f)); /* minps(q, 16): q < 16 ? q : 16 */
    return _mm512_sub_epi32(_mm512_cvttps_epi32(q), _mm512_set1_epi32(1));
}
#endif

/* A block's 128 values x encoded into its 16 words w; returns its scale. */
static inline float q4_store_block(const float *restrict x, const q4_tables_t *restrict t, int is_signed,
                                   uint32_t *restrict w) {
    float a = q4_block_scale(q4_absmax_bits(x)), inv, mul;
    q4_factors(a, is_signed, &inv, &mul);
#if defined(__AVX512F__)
    __m512i acc = _mm512_setzero_si512();
    for (int k = 0; k < 8; k++)
        acc = _mm512_or_si512(acc, _mm512_slli_epi32(
                                       q4_code16(_mm512_loadu_ps(x + 16 * k), _mm512_set1_ps(inv), t, is_signed), 4 * k));
    _mm512_storeu_si512(w, acc);
#else
    uint32_t q[Q4_BLOCK];
    for (int e = 0; e < Q4_BLOCK; e++)
        q[e] = q4_code(x[e], inv, t, is_signed);
    for (int j = 0; j < Q4_WORDS; j++) {
        uint32_t word = 0;
        for (int k = 0; k < 8; k++)
            word |= q[16 * k + j] << (4 * k);
        w[j] = word;
    }
#endif
    return a;
}

/* A block's 128 values from its 16 words w and its scale a, in element order: map * a (signed), (root * sqrt(a))**2
 * (unsigned), as quant4.unpack. */
static inline void q4_decode_block(const uint32_t *restrict w, float a, const q4_tables_t *restrict t, int is_signed,
                                   float *restrict out) {
    float inv, mul;
    q4_factors(a, is_signed, &inv, &mul);
    const float *map = t->map[is_signed ? 1 : 0];
#if defined(__AVX512F__)
    const __m512i words = _mm512_loadu_si512(w);
    const __m512 table = _mm512_loadu_ps(map), scale = _mm512_set1_ps(mul);
    for (int k = 0; k < 8; k++) { /* vpermps reads an index's low 4 bits: the nibble needs no mask */
        __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(words, 4 * k), table), scale);
        _mm512_storeu_ps(out + 16 * k, is_signed ? v : _mm512_mul_ps(v, v));
    }
#else
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < Q4_WORDS; j++) {
            float v = map[(w[j] >> (4 * k)) & 15u] * mul;
            out[16 * k + j] = is_signed ? v : v * v;
        }
#endif
}
#endif
