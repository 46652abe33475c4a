/* AdamWBF16's step on CPU for bf16 weights: the operations of adamw_bf16.py's kernels, in their order,
 * one element at a time in plain C that the compiler vectorizes (built with -O3 -ffp-contract=off, so
 * no multiply-add is fused and every fp32 operation rounds as torch's eager ops do).
 *
 * Why not inductor: its C++ for this kernel is compute-bound on the hash and the stochastic rounding (it
 * scalarizes bit casts); this loop is close to memory-bound (0.8x torch's fused fp32 AdamW step at 28M
 * parameters on 2 AVX-512 cores, moving 18 bytes per parameter against 28).
 *
 * bf16 values travel as uint16_t. coef = beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^t), eps,
 * -lr * wd, lr / (1 - beta1^t). mode: 0 kahan, 1 stochastic, 2 none. An element's index in its tensor numbers
 * its noise, as torch.arange does in the Python kernels.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "native.h"

/* One loop per mode (the mode a compile-time constant in each): a branch inside the loop would stop the
 * compiler from vectorizing it. */
#define ADAMW_BF16_LOOP(MODE)                                                                              \
    for (int64_t i = start; i < end; i++) {                                                               \
        float p32 = bf16_to_f32(p[i]);                                                                     \
        float g32 = bf16_to_f32(g[i]);                                                                     \
        float m32 = bf16_to_f32(m[i]) * b1 + g32 * omb1;                                                   \
        float v32 = clamp_max(bf16_to_f32(v[i]) * b2 + (g32 * g32) * omb2, BF16_MAX); /* see .py */      \
        m[i] = f32_to_bf16(m32);                                                                           \
        v[i] = MODE == 2 ? f32_to_bf16(v32) : round_stochastic(v32, hash32((uint32_t)key, (uint32_t)i));  \
        float denom = sqrtf(v32) * inv_bc2 + eps;                                                          \
        float update = p32 * decay - (m32 / denom) * step_size;                                            \
        p[i] = write_bf16(p32, update, MODE == 0 ? &c[i] : NULL, hash32((uint32_t)weight_key, (uint32_t)i), MODE); \
    }

static void step_one(uint16_t *restrict p, const uint16_t *restrict g, uint16_t *restrict m,
                     uint16_t *restrict v, uint16_t *restrict c, const float *coef, int32_t key,
                     int32_t weight_key, int64_t start, int64_t end, int mode) {
    const float b1 = coef[0], omb1 = coef[1], b2 = coef[2], omb2 = coef[3];
    const float inv_bc2 = coef[4], eps = coef[5], decay = coef[6], step_size = coef[7];
    if (mode == 0) {
        ADAMW_BF16_LOOP(0)
    } else if (mode == 1) {
        ADAMW_BF16_LOOP(1)
    } else {
        ADAMW_BF16_LOOP(2)
    }
}

/* Elements [start, end) of the concatenation of `count` tensors (arrays of pointers; c may be NULL unless mode
 * is 0). keys: key and weight key of each tensor. */
static void step_range(int64_t count, uint16_t *const *p, uint16_t *const *g, uint16_t *const *m,
                       uint16_t *const *v, uint16_t *const *c, const int64_t *numel, const int32_t *keys,
                       const float *coef, int64_t start, int64_t end, int mode) {
    FOR_EACH_PIECE(count, numel[t], start, end,
                   step_one(p[t], g[t], m[t], v[t], c ? c[t] : NULL, coef, keys[2 * t], keys[2 * t + 1], piece_start,
                            piece_end, mode));
}

/* The step of all the tensors in one call: [start, end) split over `threads` OpenMP threads. Built with
 * OpenMP, this is torch's own thread pool (the libgomp torch loaded is the one this library links), so it
 * does not compete with torch's threads still spinning after the backward pass; without OpenMP, one thread. */
void adamw_bf16_step(int64_t count, uint16_t *const *p, uint16_t *const *g, uint16_t *const *m,
                     uint16_t *const *v, uint16_t *const *c, const int64_t *numel, const int32_t *keys,
                     const float *coef, int mode, int64_t start, int64_t end, int threads) {
    PARALLEL_RANGES(start, end, threads,
                    step_range(count, p, g, m, v, c, numel, keys, coef, range_start, range_end, mode));
}
