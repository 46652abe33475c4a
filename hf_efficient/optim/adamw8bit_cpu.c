/* AdamW8bit's step on CPU for fp32 weights and gradients: adamw8bit._kernel's operations in its order, one
 * block of 256 elements at a time in plain C that the compiler vectorizes (-O3 -ffp-contract=off: every fp32
 * operation rounds as torch's eager ops do).
 *
 * Why not inductor: its C++ for this kernel spends ~200 vector operations per 8 elements on decoding and
 * encoding (6x torch's fused fp32 AdamW step); here decoding is a table lookup and a block's moments stay in
 * two 1 KiB buffers between the passes the absmax needs.
 *
 * maps: the signed and the unsigned map's decoded values (256 floats each, adamw8bit._decode's), then their
 * encoding thresholds (7 decade midpoints and the top one, 8 floats each, adamw8bit._THRESHOLDS). Per tensor:
 * coef[8 * t ...] = beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^t), eps, 1 - lr * wd,
 * lr / (1 - beta1^t). Codes are 64 words per block, byte 4j+k holding element 64k+j (adamw8bit's layout).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_parallel.h"

#define BLOCK 256
#define WORDS 64

/* adamw8bit._encode: the nearest code of x (in [-1, 1] signed, [0, 1] unsigned) */
static const float INV_SCALE[7] = {1e7f, 1e6f, 1e5f, 1e4f, 1e3f, 1e2f, 1e1f}; /* 10**(7 - decade) */

/* adamw8bit._encode: the nearest code of x (in [-1, 1] signed, [0, 1] unsigned) */
static inline float encode(float x, const float *thresholds, int is_signed) {
    const float first = is_signed ? 1.0f : 2.0f;
    float a = is_signed ? fabsf(x) : x;
    float n = is_signed ? 0.0f : 1.0f, inv_scale = 0.0f;
#pragma GCC unroll 7
    for (int d = 0; d < 7; d++) {
        int above = a >= thresholds[d];
        n = above ? first * (float)(1 << d) : n;
        inv_scale = above ? INV_SCALE[d] : inv_scale;
    }
    int top = x > thresholds[7];
    n = top ? first * 128.0f : n;
    inv_scale = top ? 0.0f : inv_scale;
    float k = floorf((a * inv_scale - 1.0f) * (n * (float)(1.0 / 9.0)));
    float nm1 = n - 1.0f;
    k = k < nm1 ? k : nm1; /* torch.minimum */
    k = k > 0.0f ? k : 0.0f; /* clamp_min */
    float J = n + k;
    return is_signed ? (x < 0.0f ? 127.0f - J : 127.0f + J) : J - 1.0f;
}

/* One block: p, g hold 256 elements (the last block zero-padded by the caller). */
static void step_block(float *restrict p, const float *restrict g, uint32_t *restrict wm, uint32_t *restrict wv,
                       float *restrict am, float *restrict av, const float *restrict maps,
                       const float *restrict coef) {
    const float *dm = maps, *dv = maps + 256, *tm = maps + 512, *tv = maps + 520;
    const float b1 = coef[0], omb1 = coef[1], b2 = coef[2], omb2 = coef[3];
    const float inv_bc2 = coef[4], eps = coef[5], decay = coef[6], step_size = coef[7];
    const float m_scale = *am, v_scale = *av;
    float m[BLOCK], v[BLOCK];
    for (int k = 0; k < 4; k++) {
        for (int j = 0; j < WORDS; j++) {
            int e = WORDS * k + j;
            float g32 = g[e];
            m[e] = dm[(wm[j] >> (8 * k)) & 255u] * m_scale * b1 + g32 * omb1;
            v[e] = dv[(wv[j] >> (8 * k)) & 255u] * v_scale * b2 + (g32 * g32) * omb2;
        }
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
    const float m_div = m_max > 0.0f ? m_max : 1.0f, v_div = v_max > 0.0f ? v_max : 1.0f;
    uint32_t qm[BLOCK], qv[BLOCK];
    for (int e = 0; e < BLOCK; e++)
        qm[e] = (uint32_t)(int32_t)encode(m[e] / m_div, tm, 1);
    for (int e = 0; e < BLOCK; e++)
        qv[e] = (uint32_t)(int32_t)encode(v[e] / v_div, tv, 0);
    for (int j = 0; j < WORDS; j++) {
        wm[j] = (qm[j] & 255u) | (qm[WORDS + j] & 255u) << 8 | (qm[2 * WORDS + j] & 255u) << 16 |
                (qm[3 * WORDS + j] & 255u) << 24;
        wv[j] = (qv[j] & 255u) | (qv[WORDS + j] & 255u) << 8 | (qv[2 * WORDS + j] & 255u) << 16 |
                (qv[3 * WORDS + j] & 255u) << 24;
    }
    *am = m_max;
    *av = v_max;
}

/* Blocks [start, end) of the concatenation of `count` tensors' blocks (a tensor of n elements has
 * ceil(n / 256) blocks; its last, partial block is padded with zeros here, as adamw8bit._step_8bit does). */
static void step_range(int64_t count, float *const *p, const float *const *g, uint32_t *const *wm,
                       uint32_t *const *wv, float *const *am, float *const *av, const int64_t *numel,
                       const float *maps, const float *coef, int64_t start, int64_t end) {
    int64_t offset = 0;
    for (int64_t t = 0; t < count && offset < end; t++) {
        int64_t blocks = (numel[t] + BLOCK - 1) / BLOCK;
        int64_t a = start > offset ? start - offset : 0, b = end - offset < blocks ? end - offset : blocks;
        for (int64_t i = a; i < b; i++) {
            int64_t first = i * BLOCK, valid = numel[t] - first < BLOCK ? numel[t] - first : BLOCK;
            if (valid == BLOCK) {
                step_block(p[t] + first, g[t] + first, wm[t] + i * WORDS, wv[t] + i * WORDS, am[t] + i, av[t] + i,
                           maps, coef + 8 * t);
            } else {
                float pp[BLOCK] = {0}, gg[BLOCK] = {0};
                memcpy(pp, p[t] + first, valid * sizeof(float));
                memcpy(gg, g[t] + first, valid * sizeof(float));
                step_block(pp, gg, wm[t] + i * WORDS, wv[t] + i * WORDS, am[t] + i, av[t] + i, maps, coef + 8 * t);
                memcpy(p[t] + first, pp, valid * sizeof(float));
            }
        }
        offset += blocks;
    }
}

/* The step of all the tensors in one call, blocks [start, end) split over `threads` (see native_parallel.h). */
void adamw8bit_step(int64_t count, float *const *p, const float *const *g, uint32_t *const *wm,
                    uint32_t *const *wv, float *const *am, float *const *av, const int64_t *numel,
                    const float *maps, const float *coef, int64_t start, int64_t end, int threads) {
    PARALLEL_RANGES(start, end, threads,
                    step_range(count, p, g, wm, wv, am, av, numel, maps, coef, range_start, range_end));
}
