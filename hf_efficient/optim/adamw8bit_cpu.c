/* AdamW8bit's step on CPU for fp32 or bf16 weights and gradients: adamw8bit._kernel's operations in its order, one
 * block of 256 elements at a time in plain C that the compiler vectorizes (-O3 -ffp-contract=off: every fp32
 * operation rounds as torch's eager ops do).
 *
 * Why not inductor: its C++ for this kernel spends ~200 vector operations per 8 elements on decoding and
 * encoding (5x torch's fused fp32 AdamW step); here a block's moments stay in 1 KiB buffers between the passes
 * its absmax needs, decoding looks values up, and encoding finds the decade from the float's exponent.
 * Decoding and encoding have an AVX-512 version (byte-table lookups need VBMI) beside the plain one: same
 * tables, same arithmetic, same codes (the plain one is what other CPUs run; the tests compare both with
 * the compiled kernel).
 *
 * maps: the signed and the unsigned map's decoded values (256 floats each, adamw8bit._decode's), then their
 * encoding thresholds (7 decade midpoints and the top one, 8 floats each, adamw8bit._THRESHOLDS). Per tensor:
 * coef[8 * t ...] = beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^t), eps, 1 - lr * wd,
 * lr / (1 - beta1^t). Codes are 64 words per block, byte 4j+k holding element 64k+j (adamw8bit's layout).
 */
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
    float n[16], inv_scale[16]; /* adamw8bit._encode's n and inv_scale by count of midpoints passed; 8: the top */
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
    t->is_signed = is_signed;
    for (int k = 0; k < 4; k++) /* byte 4j + b of run k's floats: byte b of element 64k + j's value */
        for (int j = 0; j < 16; j++)
            for (int b = 0; b < 4; b++) {
                t->lo_index[k][4 * j + b] = (uint8_t)((b == 1 ? 64 : 0) + 4 * j + k); /* bytes 0, 1: planes 0, 1 */
                t->hi_index[k][4 * j + b] = (uint8_t)((b == 3 ? 64 : 0) + 4 * j + k); /* bytes 2, 3: planes 2, 3 */
            }
}

/* adamw8bit._encode's last steps, given n and inv_scale: the code of x (a = |x| signed, x unsigned) */
static inline float code_of(float x, float a, float n, float inv_scale, int is_signed) {
    float k = floorf((a * inv_scale - 1.0f) * (n * (float)(1.0 / 9.0)));
    float nm1 = n - 1.0f;
    k = k < nm1 ? k : nm1; /* torch.minimum */
    k = k > 0.0f ? k : 0.0f; /* clamp_min */
    float J = n + k;
    return is_signed ? (x < 0.0f ? 127.0f - J : 127.0f + J) : J - 1.0f;
}

/* adamw8bit._encode of 256 values: the nearest code of each (x in [-1, 1] signed, [0, 1] unsigned), but never
 * the unsigned map's 0 for a positive x. The decade is the count of midpoints at or below |x|, as eager's chain of
 * comparisons finds it. */
static void encode_block(const float *restrict x, const map_t *restrict t, uint32_t *restrict q) {
#if defined(__AVX512F__)
    const __m512i b0 = _mm512_loadu_si512(t->base), b1 = _mm512_loadu_si512(t->base + 16);
    const __m512 i0 = _mm512_loadu_ps(t->inner), i1 = _mm512_loadu_ps(t->inner + 16);
    const __m512 nt = _mm512_loadu_ps(t->n), it = _mm512_loadu_ps(t->inv_scale);
    const __m512 top = _mm512_set1_ps(t->thresholds[7]), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const __m512 ninth = _mm512_set1_ps((float)(1.0 / 9.0)), c127 = _mm512_set1_ps(127.0f);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int e = 0; e < BLOCK; e += 16) {
        __m512 v = _mm512_loadu_ps(x + e);
        __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
        __m512 a = t->is_signed ? _mm512_castsi512_ps(bits) : v;
        __m512i idx = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(EXP0));
        idx = _mm512_min_epi32(_mm512_max_epi32(idx, _mm512_setzero_si512()), _mm512_set1_epi32(31));
        __m512i count = _mm512_permutex2var_epi32(b0, idx, b1);
        __mmask16 up = _mm512_cmp_ps_mask(a, _mm512_permutex2var_ps(i0, idx, i1), _CMP_GE_OQ);
        count = _mm512_mask_add_epi32(count, up, count, _mm512_set1_epi32(1));
        count = _mm512_mask_mov_epi32(count, _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ), _mm512_set1_epi32(8));
        __m512 n = _mm512_permutexvar_ps(count, nt), inv_scale = _mm512_permutexvar_ps(count, it);
        __m512 k = _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps(a, inv_scale), one), _mm512_mul_ps(n, ninth));
        k = _mm512_roundscale_ps(k, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        k = _mm512_max_ps(_mm512_min_ps(k, _mm512_sub_ps(n, one)), zero);
        __m512 J = _mm512_add_ps(n, k), code;
        if (t->is_signed)
            code = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), _mm512_add_ps(c127, J),
                                        _mm512_sub_ps(c127, J));
        else /* a positive value keeps the smallest positive code (see adamw8bit._encode) */
            code = _mm512_mask_max_ps(_mm512_sub_ps(J, one), _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ),
                                      _mm512_sub_ps(J, one), one);
        _mm512_storeu_si512(q + e, _mm512_cvttps_epi32(code));
    }
#else
    for (int e = 0; e < BLOCK; e++) {
        float a = t->is_signed ? fabsf(x[e]) : x[e];
        int count = 0;
        for (int d = 0; d < 7; d++)
            count += a >= t->thresholds[d];
        count = x[e] > t->thresholds[7] ? 8 : count;
        float code = code_of(x[e], a, t->n[count], t->inv_scale[count], t->is_signed);
        /* unsigned: a positive value keeps the smallest positive code (see adamw8bit._encode) */
        code = !t->is_signed && x[e] > 0.0f && code < 1.0f ? 1.0f : code;
        q[e] = (uint32_t)(int32_t)code;
    }
#endif
}

/* The 256 decoded values of a block's codes, in element order. */
static void decode_block(const uint32_t *restrict w, const map_t *restrict t, float *restrict out) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
    /* 64 codes at a time: the 4 bytes of their values from 4 byte tables (256 entries: two 128-byte lookups and a
     * blend on the code's top bit), then the bytes of element 64k + j (byte 4j + k of each plane) gathered into
     * one float: dword j of run k. */
    __m512i planes[4][4];
    for (int b = 0; b < 4; b++)
        for (int h = 0; h < 4; h++)
            planes[b][h] = _mm512_loadu_si512(t->planes[b] + 64 * h);
    for (int c = 0; c < WORDS / 16; c++) {
        __m512i codes = _mm512_loadu_si512(w + 16 * c), bytes[4];
        __mmask64 high = _mm512_movepi8_mask(codes);
        for (int b = 0; b < 4; b++)
            bytes[b] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(planes[b][0], codes, planes[b][1]),
                                              _mm512_permutex2var_epi8(planes[b][2], codes, planes[b][3]));
        for (int k = 0; k < 4; k++) {
            __m512i lo = _mm512_permutex2var_epi8(bytes[0], _mm512_loadu_si512(t->lo_index[k]), bytes[1]);
            __m512i hi = _mm512_permutex2var_epi8(bytes[2], _mm512_loadu_si512(t->hi_index[k]), bytes[3]);
            _mm512_storeu_si512(out + WORDS * k + 16 * c, _mm512_mask_blend_epi8(0xCCCCCCCCCCCCCCCCull, lo, hi));
        }
    }
#else
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < WORDS; j++)
            out[WORDS * k + j] = t->decoded[(w[j] >> (8 * k)) & 255u];
#endif
}

/* One block: p, g hold 256 elements (the last block zero-padded by the caller). */
static void step_block(float *restrict p, const float *restrict g, uint32_t *restrict wm, uint32_t *restrict wv,
                       float *restrict am, float *restrict av, const map_t *restrict maps,
                       const float *restrict coef) {
    const float b1 = coef[0], omb1 = coef[1], b2 = coef[2], omb2 = coef[3];
    const float inv_bc2 = coef[4], eps = coef[5], decay = coef[6], step_size = coef[7];
    const float m_scale = *am, v_scale = *av;
    float m[BLOCK], v[BLOCK];
    decode_block(wm, &maps[0], m);
    decode_block(wv, &maps[1], v);
    for (int e = 0; e < BLOCK; e++) {
        float g32 = g[e];
        /* v clamped to fp32's range (see adamw8bit._kernel; m, a convex combination, needs none) */
        m[e] = m[e] * m_scale * b1 + g32 * omb1;
        v[e] = clamp_max(v[e] * v_scale * b2 + (g32 * g32) * omb2, F32_MAX);
    }
    /* absmax as the largest bit pattern of |x|: the same order for non-negative floats, vectorizable, and a NaN
     * (above inf) wins as in torch's amax */
    uint32_t m_bits = 0, v_bits = 0;
    for (int e = 0; e < BLOCK; e++) {
        uint32_t a, b;
        memcpy(&a, &m[e], 4);
        memcpy(&b, &v[e], 4);
        a &= 0x7FFFFFFFu;
        b &= 0x7FFFFFFFu;
        m_bits = a > m_bits ? a : m_bits;
        v_bits = b > v_bits ? b : v_bits;
    }
    float m_max, v_max;
    memcpy(&m_max, &m_bits, 4);
    memcpy(&v_max, &v_bits, 4);
    for (int e = 0; e < BLOCK; e++) {
        float denom = sqrtf(v[e]) * inv_bc2 + eps;
        p[e] = p[e] * decay - (m[e] / denom) * step_size;
    }
    const float m_inv = 1.0f / (m_max > 0.0f ? m_max : 1.0f), v_inv = 1.0f / (v_max > 0.0f ? v_max : 1.0f);
    for (int e = 0; e < BLOCK; e++) {
        m[e] = m[e] * m_inv;
        v[e] = v[e] * v_inv;
    }
    uint32_t qm[BLOCK], qv[BLOCK];
    encode_block(m, &maps[0], qm);
    encode_block(v, &maps[1], qv);
    for (int j = 0; j < WORDS; j++) {
        wm[j] = (qm[j] & 255u) | (qm[WORDS + j] & 255u) << 8 | (qm[2 * WORDS + j] & 255u) << 16 |
                (qm[3 * WORDS + j] & 255u) << 24;
        wv[j] = (qv[j] & 255u) | (qv[WORDS + j] & 255u) << 8 | (qv[2 * WORDS + j] & 255u) << 16 |
                (qv[3 * WORDS + j] & 255u) << 24;
    }
    *am = m_max;
    *av = v_max;
}

/* Block i of tensor x (fp32, or bf16 where is_bf16) into 256 floats, zero-padded past `valid` elements. */
static void load_block(float *restrict out, const void *x, int64_t i, int64_t valid, int is_bf16) {
    memset(out, 0, BLOCK * sizeof(float));
    if (is_bf16)
        for (int64_t e = 0; e < valid; e++)
            out[e] = bf16_to_f32(((const uint16_t *)x)[i * BLOCK + e]);
    else
        memcpy(out, (const float *)x + i * BLOCK, valid * sizeof(float));
}

/* Blocks [first, last) of one tensor of n elements (its last, partial block padded with zeros here, as
 * adamw8bit._step_8bit does). Weights and gradients are fp32, or bf16 where is_bf16 (rounded to nearest even
 * on store, as torch's copy_). */
static void step_blocks(void *p, const void *g, uint32_t *wm, uint32_t *wv, float *am, float *av, int64_t n,
                        int is_bf16, const map_t *maps, const float *coef, int64_t first, int64_t last) {
    for (int64_t i = first; i < last; i++) {
        int64_t valid = n - i * BLOCK < BLOCK ? n - i * BLOCK : BLOCK;
        if (valid == BLOCK && !is_bf16) {
            step_block((float *)p + i * BLOCK, (const float *)g + i * BLOCK, wm + i * WORDS, wv + i * WORDS, am + i,
                       av + i, maps, coef);
            continue;
        }
        float pp[BLOCK], gg[BLOCK];
        load_block(pp, p, i, valid, is_bf16);
        load_block(gg, g, i, valid, is_bf16);
        step_block(pp, gg, wm + i * WORDS, wv + i * WORDS, am + i, av + i, maps, coef);
        if (is_bf16)
            for (int64_t e = 0; e < valid; e++)
                ((uint16_t *)p)[i * BLOCK + e] = f32_to_bf16(pp[e]);
        else
            memcpy((float *)p + i * BLOCK, pp, valid * sizeof(float));
    }
}

/* Blocks [start, end) of the concatenation of `count` tensors' blocks (ceil(n / 256) for n elements). */
static void step_range(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, uint32_t *const *wv,
                       float *const *am, float *const *av, const int64_t *numel, const int32_t *bf16,
                       const map_t *maps, const float *coef, int64_t start, int64_t end) {
    FOR_EACH_PIECE(count, (numel[t] + BLOCK - 1) / BLOCK, start, end,
                   step_blocks(p[t], g[t], wm[t], wv[t], am[t], av[t], numel[t], bf16[t], maps, coef + 8 * t,
                               piece_start, piece_end));
}

/* The step of all the tensors in one call, blocks [start, end) split over `threads` (see native.h). */
void adamw8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, uint32_t *const *wv,
                    float *const *am, float *const *av, const int64_t *numel, const int32_t *bf16,
                    const float *maps, const float *coef, int64_t start, int64_t end, int threads) {
    map_t tables[2];
    build_map(&tables[0], maps, maps + 512, 1);
    build_map(&tables[1], maps + 256, maps + 520, 0);
    PARALLEL_RANGES(start, end, threads,
                    step_range(count, p, g, wm, wv, am, av, numel, bf16, tables, coef, range_start, range_end));
}
