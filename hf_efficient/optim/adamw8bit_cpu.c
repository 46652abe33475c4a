/* AdamW8bit's step on CPU for fp32 or bf16 weights and gradients: adamw8bit._kernel's operations in its order, one
 * block of 256 elements at a time: in plain C that the compiler vectorizes (step_block, through quant8.h's block
 * buffers), and on AVX-512 VBMI CPUs whole blocks in one fused vector pass in place (step_block_fused, the same
 * results). Built with -O3 -ffp-contract=off: every fp32 operation rounds as torch's eager ops do.
 *
 * Why not inductor: its C++ for this kernel spends most of its vector operations on decoding and encoding (it
 * cannot look values up or read a float's exponent; docs/results/bench_step.md has the times); here a block's moments stay in 1 KiB buffers between the passes
 * its absmax needs, decoding looks values up, and encoding finds the decade from the float's exponent.
 * The codec (tables, decoding, encoding, layout) is quant8.h's, shared with the other 8-bit kernels.
 *
 * maps: quant8.c_tables(). coef: an adamw8bit_coef_t per tensor (adamw8bit._coefficients). Codes in quant8's
 * in-memory layout. bf16 weights are written under compensation `mode` (c: each tensor's Kahan buffer or NULL; keys:
 * each tensor's weight noise key).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"
#include "quant8.h"

/* adamw8bit._kernel's scalars, in the order adamw8bit._coefficients writes them. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float inv_bias_correction2_sqrt; /* 1 / sqrt(1 - beta2^t) */
    float eps;
    float decay;     /* 1 - lr * wd */
    float step_size; /* lr / (1 - beta1^t) */
} adamw8bit_coef_t;
_Static_assert(sizeof(adamw8bit_coef_t) == 8 * sizeof(float), "adamw8bit._coefficients writes 8 floats per tensor");

/* One block: p, g hold 256 elements (the last block zero-padded by the caller). */
static void step_block(float *restrict p, const float *restrict g, uint32_t *restrict wm, uint32_t *restrict wv,
                       float *restrict am, float *restrict av, const map_t *restrict maps,
                       const adamw8bit_coef_t *restrict k) {
    const float b1 = k->beta1, omb1 = k->one_minus_beta1, b2 = k->beta2, omb2 = k->one_minus_beta2;
    const float inv_bc2 = k->inv_bias_correction2_sqrt, eps = k->eps, decay = k->decay, step_size = k->step_size;
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
    for (int e = 0; e < BLOCK; e++) {
        float denom = sqrtf(v[e]) * inv_bc2 + eps;
        p[e] = p[e] * decay - (m[e] / denom) * step_size;
    }
    *am = store_block(m, &maps[0], wm);
    *av = store_block(v, &maps[1], wv);
}

#if defined(QUANT8_VBMI)
/* step_block on the whole block at element `off` of the tensors (c: the Kahan buffer's start), read and written in
 * place, 16 elements at a time: both moments decoded into 1 KiB buffers, then one pass updates them (with their
 * absmax), steps the weight and writes it (bf16: under compensation `mode`), then both are encoded. The same
 * operations on the same values as step_block (see step_blocks), so the same results, in less time: no block
 * copies, weight and moments in one pass (the moments interleaved with their decoding were slower still). */
static void step_block_fused(void *p, const void *g, int is_bf16, uint16_t *c, uint32_t key, comp_mode_t mode,
                             int64_t off, uint32_t *restrict wm, uint32_t *restrict wv, float *restrict am,
                             float *restrict av, const map_t *restrict maps, const adamw8bit_coef_t *restrict k) {
    const __m512 b1 = _mm512_set1_ps(k->beta1), omb1 = _mm512_set1_ps(k->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(k->beta2), omb2 = _mm512_set1_ps(k->one_minus_beta2);
    const __m512 inv_bc2 = _mm512_set1_ps(k->inv_bias_correction2_sqrt), eps = _mm512_set1_ps(k->eps);
    const __m512 decay = _mm512_set1_ps(k->decay), step_size = _mm512_set1_ps(k->step_size);
    const __m512 m_scale = _mm512_set1_ps(*am), v_scale = _mm512_set1_ps(*av), vmax = _mm512_set1_ps(F32_MAX);
    float m[BLOCK], v[BLOCK];
    __m512i m_max = _mm512_setzero_si512(), v_max = _mm512_setzero_si512();
    decode_block(wm, &maps[0], m);
    decode_block(wv, &maps[1], v);
    for (int e = 0; e < BLOCK; e += 16) {
        __m512 g32 = load16(g, off + e, is_bf16);
        __m512 mk = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(m + e), m_scale), b1),
                                  _mm512_mul_ps(g32, omb1));
        __m512 vk = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(v + e), v_scale), b2),
                                  _mm512_mul_ps(_mm512_mul_ps(g32, g32), omb2));
        vk = _mm512_mask_mov_ps(vk, _mm512_cmp_ps_mask(vk, vmax, _CMP_GT_OQ), vmax); /* clamp_max: NaN stays */
        _mm512_storeu_ps(m + e, mk);
        _mm512_storeu_ps(v + e, vk);
        m_max = absmax16(m_max, mk);
        v_max = absmax16(v_max, vk);
        __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vk), inv_bc2), eps);
        __m512 old = load16(p, off + e, is_bf16);
        store_weights16(p, off + e, is_bf16, old,
                        _mm512_sub_ps(_mm512_mul_ps(old, decay), _mm512_mul_ps(_mm512_div_ps(mk, denom), step_size)),
                        c, key, mode);
    }
    *am = store_block_max(m, (uint32_t)_mm512_reduce_max_epu32(m_max), &maps[0], wm);
    *av = store_block_max(v, (uint32_t)_mm512_reduce_max_epu32(v_max), &maps[1], wv);
}
#endif

/* Blocks [first, last) of one tensor of n elements: whole blocks by step_block_fused where it is built (it reads and
 * writes the tensors in place, with the same results), else whole fp32 blocks by step_block in place; the others
 * (bf16, the last partial one) by step_block through quant8.h's block buffers. */
static void step_blocks(void *p, const void *g, uint32_t *wm, uint32_t *wv, float *am, float *av, int64_t n,
                        int is_bf16, uint16_t *c, uint32_t key, comp_mode_t mode, const map_t *maps,
                        const adamw8bit_coef_t *k, int64_t first, int64_t last) {
    for (int64_t i = first; i < last; i++) {
        const int64_t valid = block_valid(n, i);
#if defined(QUANT8_VBMI)
        if (valid == BLOCK) {
            step_block_fused(p, g, is_bf16, c, key, mode, i * BLOCK, wm + i * WORDS, wv + i * WORDS, am + i, av + i,
                             maps, k);
            continue;
        }
#endif
        if (valid == BLOCK && !is_bf16) {
            step_block((float *)p + i * BLOCK, (const float *)g + i * BLOCK, wm + i * WORDS, wv + i * WORDS, am + i,
                       av + i, maps, k);
            continue;
        }
        block_buf_t b;
        block_load(&b, p, g, i, valid, is_bf16, mode);
        step_block(b.p, b.g, wm + i * WORDS, wv + i * WORDS, am + i, av + i, maps, k);
        block_store(&b, p, c, key, i, valid, is_bf16, mode);
    }
}

/* Blocks [start, end) of the concatenation of `count` tensors' blocks (ceil(n / 256) for n elements). */
static void step_range(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, uint32_t *const *wv,
                       float *const *am, float *const *av, const int64_t *numel, const int32_t *bf16,
                       uint16_t *const *c, const int32_t *keys, comp_mode_t mode, const map_t *maps,
                       const adamw8bit_coef_t *coef, int64_t start, int64_t end) {
    int64_t lo, hi;
    for (int64_t t = 0, offset = 0; t < count && offset < end; offset += quant8_blocks(numel[t]), t++)
        if (piece(start, end, offset, quant8_blocks(numel[t]), &lo, &hi))
            step_blocks(p[t], g[t], wm[t], wv[t], am[t], av[t], numel[t], bf16[t], c[t], (uint32_t)keys[t], mode,
                        maps, &coef[t], lo, hi);
}

/* The step of all the tensors in one call, blocks [start, end) split over `threads` (see native.h's thread_range). */
void adamw8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, uint32_t *const *wv,
                    float *const *am, float *const *av, const int64_t *numel, const int32_t *bf16,
                    uint16_t *const *c, const int32_t *keys, comp_mode_t mode, const float *maps,
                    const adamw8bit_coef_t *coef, int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        if (thread_range(start, end, &lo, &hi))
            step_range(count, p, g, wm, wv, am, av, numel, bf16, c, keys, mode, tables, coef, lo, hi);
    }
}
