/* Lion8bit's step on CPU for fp32 or bf16 weights and gradients: lion8bit._kernel's operations in its order, one
 * block of 256 elements at a time in plain C that the compiler vectorizes, and on AVX-512 VBMI CPUs whole blocks in
 * one fused vector pass (as adamw8bit_cpu.c; -O3 -ffp-contract=off: every fp32 operation rounds as torch's eager ops
 * do). The codec (tables, decoding, encoding, layout) is quant8.h's.
 *
 * maps: quant8.c_tables(). Per tensor: coef[6 * t ...] = beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * wd, lr.
 * bf16 weights are written under compensation `mode`, as adamw8bit_cpu.c's.
 *
 * lion_step: Lion on fp32 momenta for bf16 weights (small tensors, and those named to keep fp32 state), what
 * lion8bit.lion does on CPU (its torch operations in their order, then compensation.write_all's write) in one pass.
 */
#include "native.h"
#include "quant8.h"

/* One block: p, g hold 256 elements (the last block zero-padded by the caller). */
static void step_block(float *restrict p, const float *restrict g, uint32_t *restrict wm, float *restrict am,
                       const map_t *restrict map, const float *restrict coef) {
    const float b1 = coef[0], omb1 = coef[1], b2 = coef[2], omb2 = coef[3], decay = coef[4], lr = coef[5];
    const float scale = *am;
    float m[BLOCK];
    decode_block(wm, map, m);
    for (int e = 0; e < BLOCK; e++) {
        float g32 = g[e], mm = m[e] * scale;
        float u = mm * b1 + g32 * omb1;
        float s = (float)(u > 0.0f) - (float)(u < 0.0f); /* torch.sign: 0 for 0 and NaN */
        p[e] = p[e] * decay - s * lr;
        m[e] = mm * b2 + g32 * omb2;
    }
    *am = store_block(m, map, wm);
}

#if defined(QUANT8_VBMI)
/* step_block on the whole block at element `off` of the tensors, read and written in place 16 elements at a time
 * (as adamw8bit_cpu.c's step_block_fused: same operations, same results, no block copies). */
static void step_block_fused(void *p, const void *g, int is_bf16, uint16_t *c, uint32_t key, int mode, int64_t off,
                             uint32_t *restrict wm, float *restrict am, const map_t *restrict map,
                             const float *restrict coef) {
    const __m512 b1 = _mm512_set1_ps(coef[0]), omb1 = _mm512_set1_ps(coef[1]), b2 = _mm512_set1_ps(coef[2]);
    const __m512 omb2 = _mm512_set1_ps(coef[3]), decay = _mm512_set1_ps(coef[4]), lr = _mm512_set1_ps(coef[5]);
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

static void step_blocks(void *p, const void *g, uint32_t *wm, float *am, int64_t n, int is_bf16, uint16_t *c,
                        int32_t key, int mode, const map_t *map, const float *coef, int64_t first, int64_t last) {
    FOR_EACH_BLOCK(p, g, c, key, mode, n, is_bf16, first, last, step_block(pb, gb, wm + i * WORDS, am + i, map, coef),
                   step_block_fused(p, g, is_bf16, c, (uint32_t)key, mode, i * BLOCK, wm + i * WORDS, am + i, map,
                                    coef));
}

static void step_range(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, float *const *am,
                       const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys, int mode,
                       const map_t *map, const float *coef, int64_t start, int64_t end) {
    FOR_EACH_PIECE(count, (numel[t] + BLOCK - 1) / BLOCK, start, end,
                   step_blocks(p[t], g[t], wm[t], am[t], numel[t], bf16[t], c[t], keys[t], mode, map, coef + 6 * t,
                               piece_start, piece_end));
}

/* The step of all the tensors in one call, blocks [start, end) split over `threads` (see native.h). */
void lion8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *wm, float *const *am,
                   const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys, int mode,
                   const float *maps, const float *coef, int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
    PARALLEL_RANGES(start, end, threads,
                    step_range(count, p, g, wm, am, numel, bf16, c, keys, mode, &tables[0], coef, range_start,
                               range_end));
}

/* lion8bit.lion on elements [start, end) of one bf16 weight tensor with its fp32 momentum m (coef: as above). */
static void fp32_one(uint16_t *restrict p, const void *g, int g_bf16, float *restrict m, uint16_t *restrict c,
                     int32_t key, const float *coef, int mode, int64_t start, int64_t end) {
    const float b1 = coef[0], omb1 = coef[1], b2 = coef[2], omb2 = coef[3], decay = coef[4], lr = coef[5];
    BF16_WEIGHT_LOOPS(p, g, g_bf16, c, key, mode, start, end, {
        float mm = m[i];
        float u = mm * b1 + g32 * omb1;
        fresh = p32 * decay - ((float)(u > 0.0f) - (float)(u < 0.0f)) * lr; /* torch.sign: 0 for 0 and NaN */
        m[i] = mm * b2 + g32 * omb2;
    })
}

/* Elements [start, end) of the concatenation of `count` tensors (states: their momenta), split over `threads`. */
void lion_step(int64_t count, uint16_t *const *p, const void *const *g, float *const *states, uint16_t *const *c,
               const int64_t *numel, const int32_t *g_bf16, const int32_t *keys, const float *coef, int mode,
               int64_t start, int64_t end, int threads) {
    PARALLEL_RANGES(start, end, threads,
                    FOR_EACH_PIECE(count, numel[t], range_start, range_end,
                                   fp32_one(p[t], g[t], g_bf16[t], states[t], c ? c[t] : NULL, keys[t], coef + 6 * t,
                                            mode, piece_start, piece_end)));
}
