/* Lion8bit's step on CPU for fp32 or bf16 weights and gradients: lion8bit._kernel's operations in its order, one
 * block of 256 elements at a time in plain C that the compiler vectorizes, and on AVX-512 VBMI CPUs whole blocks in
 * one fused vector pass (as adamw8bit_cpu.c; -O3 -ffp-contract=off: every fp32 operation rounds as torch's eager ops
 * do). The codec (tables, decoding, encoding, layout) is quant8.h's.
 *
 * maps: quant8.c_tables(). coef: a lion_coef_t per tensor (lion8bit._c_coefficients). bf16 weights are written under
 * compensation `mode`, as adamw8bit_cpu.c's.
 *
 * lion_step: Lion on fp32 momenta for bf16 weights (small tensors, and those named to keep fp32 state), what
 * lion8bit.lion does on CPU (its torch operations in their order, then compensation.write_all's write) in one pass.
 */
#include <stdint.h>
#include <string.h>

#include "native.h"
#include "quant8.h"

/* lion8bit._kernel's scalars, in the order lion8bit._c_coefficients writes them. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float decay; /* 1 - lr * wd */
    float lr;
} lion_coef_t;
_Static_assert(sizeof(lion_coef_t) == 6 * sizeof(float), "lion8bit._c_coefficients writes 6 floats per tensor");

/* torch.sign: 0 for 0 and NaN. */
ALWAYS_INLINE float sign(float u) { return (float)(u > 0.0f) - (float)(u < 0.0f); }

/* One block: p, g hold 256 elements (the last block zero-padded by the caller). */
static void step_block(float *restrict p, const float *restrict g, uint32_t *restrict wm, float *restrict am,
                       const map_t *restrict map, const lion_coef_t *restrict k) {
    const float b1 = k->beta1, omb1 = k->one_minus_beta1, b2 = k->beta2, omb2 = k->one_minus_beta2;
    const float decay = k->decay, lr = k->lr, scale = *am;
    float m[BLOCK];
    decode_block(wm, map, m);
    for (int e = 0; e < BLOCK; e++) {
        float g32 = g[e], mm = m[e] * scale;
        p[e] = p[e] * decay - sign(mm * b1 + g32 * omb1) * lr;
        m[e] = mm * b2 + g32 * omb2;
    }
    *am = store_block(m, map, wm);
}

#if defined(QUANT8_VBMI)
/* step_block on the whole block at element `off` of the tensors, read and written in place 16 elements at a time
 * (as adamw8bit_cpu.c's step_block_fused: same operations, same results, no block copies). */
static void step_block_fused(void *p, const void *g, int is_bf16, uint16_t *c, uint32_t key, comp_mode_t mode,
                             int64_t off, uint32_t *restrict wm, float *restrict am, const map_t *restrict map,
                             const lion_coef_t *restrict k) {
    const __m512 b1 = _mm512_set1_ps(k->beta1), omb1 = _mm512_set1_ps(k->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(k->beta2), omb2 = _mm512_set1_ps(k->one_minus_beta2);
    const __m512 decay = _mm512_set1_ps(k->decay), lr = _mm512_set1_ps(k->lr);
    const __m512 scale = _mm512_set1_ps(*am), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    float m[BLOCK];
    __m512i m_max = _mm512_setzero_si512();
    decode_block(wm, map, m);
    for (int e = 0; e < BLOCK; e += 16) {
        __m512 g32 = load16(g, off + e, is_bf16), mm = _mm512_mul_ps(_mm512_loadu_ps(m + e), scale);
        __m512 u = _mm512_add_ps(_mm512_mul_ps(mm, b1), _mm512_mul_ps(g32, omb1));
        __m512 s = _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, zero, _CMP_GT_OQ), one),
                                 _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, zero, _CMP_LT_OQ), one)); /* torch.sign */
        __m512 old = load16(p, off + e, is_bf16);
        store_weights16(p, off + e, is_bf16, old, _mm512_sub_ps(_mm512_mul_ps(old, decay), _mm512_mul_ps(s, lr)), c,
                        key, mode);
        __m512 mk = _mm512_add_ps(_mm512_mul_ps(mm, b2), _mm512_mul_ps(g32, omb2));
        _mm512_storeu_ps(m + e, mk);
        m_max = absmax16(m_max, mk);
    }
    *am = store_block_max(m, (uint32_t)_mm512_reduce_max_epu32(m_max), map, wm);
}
#endif

/* Blocks [first, last) of one tensor of n elements, as adamw8bit_cpu.c's step_blocks. */
static void step_blocks(void *p, const void *g, uint32_t *wm, float *am, int64_t n, int is_bf16, uint16_t *c,
                        uint32_t key, comp_mode_t mode, const map_t *map, const lion_coef_t *k, int64_t first,
                        int64_t last) {
    for (int64_t i = first; i < last; i++) {
        const int64_t valid = block_valid(n, i);
#if defined(QUANT8_VBMI)
        if (valid == BLOCK) {
            step_block_fused(p, g, is_bf16, c, key, mode, i * BLOCK, wm + i * WORDS, am + i, map, k);
            continue;
        }
#endif
        if (valid == BLOCK && !is_bf16) {
            step_block((float *)p + i * BLOCK, (const float *)g + i * BLOCK, wm + i * WORDS, am + i, map, k);
            continue;
        }
        block_buf_t b;
        block_load(&b, p, g, i, valid, is_bf16, mode);
        step_block(b.p, b.g, wm + i * WORDS, am + i, map, k);
        block_store(&b, p, c, key, i, valid, is_bf16, mode);
    }
}

static void step_range(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, float *const *am,
                       const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys,
                       comp_mode_t mode, const map_t *map, const lion_coef_t *coef, int64_t start, int64_t end) {
    int64_t lo, hi;
    for (int64_t t = 0, offset = 0; t < count && offset < end; offset += quant8_blocks(numel[t]), t++)
        if (piece(start, end, offset, quant8_blocks(numel[t]), &lo, &hi))
            step_blocks(p[t], g[t], wm[t], am[t], numel[t], bf16[t], c[t], (uint32_t)keys[t], mode, map, &coef[t],
                        lo, hi);
}

/* The step of all the tensors in one call, blocks [start, end) split over `threads` (see native.h's thread_range). */
void lion8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, float *const *am,
                   const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys,
                   comp_mode_t mode, const float *maps, const lion_coef_t *coef, int64_t start, int64_t end,
                   int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        if (thread_range(start, end, &lo, &hi))
            step_range(count, p, g, wm, am, numel, bf16, c, keys, mode, &tables[0], coef, lo, hi);
    }
}

/* lion8bit.lion on elements [start, end) of one bf16 weight tensor with its fp32 momentum m, with the gradient's
 * dtype and the mode constants where it is inlined (a branch on either inside the loop would stop the vectorizer). */
ALWAYS_INLINE void fp32_loop(uint16_t *restrict p, const void *g, float *restrict m, uint16_t *restrict c,
                             uint32_t key, const lion_coef_t *k, int64_t start, int64_t end, const int g_bf16,
                             const comp_mode_t mode) {
    const float b1 = k->beta1, omb1 = k->one_minus_beta1, b2 = k->beta2, omb2 = k->one_minus_beta2;
    const float decay = k->decay, lr = k->lr;
    for (int64_t i = start; i < end; i++) {
        float p32 = bf16_to_f32(p[i]), g32 = load_f32(g, i, g_bf16), mm = m[i];
        float fresh = p32 * decay - sign(mm * b1 + g32 * omb1) * lr;
        m[i] = mm * b2 + g32 * omb2;
        p[i] = write_weight(p32, fresh, c, key, i, mode);
    }
}

static void fp32_one(uint16_t *restrict p, const void *g, int g_bf16, float *restrict m, uint16_t *restrict c,
                     uint32_t key, const lion_coef_t *k, comp_mode_t mode, int64_t start, int64_t end) {
    if (g_bf16) {
        if (mode == KAHAN)
            fp32_loop(p, g, m, c, key, k, start, end, 1, KAHAN);
        else if (mode == STOCHASTIC)
            fp32_loop(p, g, m, c, key, k, start, end, 1, STOCHASTIC);
        else
            fp32_loop(p, g, m, c, key, k, start, end, 1, NONE);
    } else {
        if (mode == KAHAN)
            fp32_loop(p, g, m, c, key, k, start, end, 0, KAHAN);
        else if (mode == STOCHASTIC)
            fp32_loop(p, g, m, c, key, k, start, end, 0, STOCHASTIC);
        else
            fp32_loop(p, g, m, c, key, k, start, end, 0, NONE);
    }
}

/* Elements [start, end) of the concatenation of `count` tensors (states: their momenta), split over `threads`. */
void lion_step(int64_t count, uint16_t *const *p, const void *const *g, float *const *states, uint16_t *const *c,
               const int64_t *numel, const int32_t *g_bf16, const int32_t *keys, const lion_coef_t *coef,
               comp_mode_t mode, int64_t start, int64_t end, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        if (thread_range(start, end, &lo, &hi))
            for (int64_t t = 0, offset = 0; t < count && offset < hi; offset += numel[t], t++) {
                int64_t a, b;
                if (piece(lo, hi, offset, numel[t], &a, &b))
                    fp32_one(p[t], g[t], g_bf16[t], states[t], c ? c[t] : NULL, (uint32_t)keys[t], &coef[t], mode,
                             a, b);
            }
    }
}
