/* AdamWBF16's step on CPU for bf16 weights: the operations of adamw_bf16.py's kernels, in their order,
 * one element at a time in plain C that the compiler vectorizes (built with -O3 -ffp-contract=off, so
 * no multiply-add is fused and every fp32 operation rounds as torch's eager ops do).
 *
 * Why not inductor: its C++ for this kernel is compute-bound on the hash and the stochastic rounding (it
 * scalarizes bit casts); this loop is close to memory-bound, moving 18 bytes per parameter against fused fp32
 * AdamW's 28 (times: docs/results/bench_step.md).
 *
 * bf16 values travel as uint16_t. coef: an adamw_bf16_coef_t per call (adamw_bf16._coefficients). An element's
 * index in its tensor numbers its noise, as torch.arange does in the Python kernels.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

/* adamw_bf16.py's kernels' scalars, in the order adamw_bf16._coefficients writes them. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float inv_bias_correction2_sqrt; /* 1 / sqrt(1 - beta2^t) */
    float eps;
    /* -lr * wd, not the other kernels' decay = 1 - lr * wd: the Python kernels compute the step's delta,
     * p * (-lr * wd) - (m / denom) * step_size, and compensate that; p * (1 - lr * wd) - p would round otherwise. */
    float neg_lr_wd;
    float step_size; /* lr / (1 - beta1^t) */
} adamw_bf16_coef_t;
_Static_assert(sizeof(adamw_bf16_coef_t) == 8 * sizeof(float), "adamw_bf16._coefficients writes 8 floats");

/* Elements [start, end) of one tensor, with the mode a constant where it is inlined: a branch on it inside the loop
 * would stop the vectorizer. key: the second moment's noise key; weight_key: the weight's. */
ALWAYS_INLINE void step_loop(uint16_t *restrict p, const uint16_t *restrict g, uint16_t *restrict m,
                             uint16_t *restrict v, uint16_t *restrict c, const adamw_bf16_coef_t *k, uint32_t key,
                             uint32_t weight_key, int64_t start, int64_t end, const comp_mode_t mode) {
    const float b1 = k->beta1, omb1 = k->one_minus_beta1, b2 = k->beta2, omb2 = k->one_minus_beta2;
    const float inv_bc2 = k->inv_bias_correction2_sqrt, eps = k->eps, neg_lr_wd = k->neg_lr_wd;
    const float step_size = k->step_size;
    for (int64_t i = start; i < end; i++) {
        float p32 = bf16_to_f32(p[i]);
        float g32 = bf16_to_f32(g[i]);
        float m32 = bf16_to_f32(m[i]) * b1 + g32 * omb1;
        float v32 = clamp_max(bf16_to_f32(v[i]) * b2 + (g32 * g32) * omb2, BF16_MAX); /* see .py */
        m[i] = f32_to_bf16(m32);
        v[i] = mode == NONE ? f32_to_bf16(v32) : round_stochastic(v32, hash32(key, (uint32_t)i));
        float denom = sqrtf(v32) * inv_bc2 + eps;
        float update = p32 * neg_lr_wd - (m32 / denom) * step_size;
        p[i] = write_bf16(p32, update, mode == KAHAN ? &c[i] : NULL, hash32(weight_key, (uint32_t)i), mode);
    }
}

static void step_one(uint16_t *restrict p, const uint16_t *restrict g, uint16_t *restrict m,
                     uint16_t *restrict v, uint16_t *restrict c, const adamw_bf16_coef_t *k, uint32_t key,
                     uint32_t weight_key, int64_t start, int64_t end, comp_mode_t mode) {
    if (mode == KAHAN)
        step_loop(p, g, m, v, c, k, key, weight_key, start, end, KAHAN);
    else if (mode == STOCHASTIC)
        step_loop(p, g, m, v, c, k, key, weight_key, start, end, STOCHASTIC);
    else
        step_loop(p, g, m, v, c, k, key, weight_key, start, end, NONE);
}

/* Elements [start, end) of the concatenation of `count` tensors (arrays of pointers; c may be NULL unless mode
 * is KAHAN). keys: key and weight key of each tensor. */
static void step_range(int64_t count, uint16_t *const *p, uint16_t *const *g, uint16_t *const *m,
                       uint16_t *const *v, uint16_t *const *c, const int64_t *numel, const int32_t *keys,
                       const adamw_bf16_coef_t *k, int64_t start, int64_t end, comp_mode_t mode) {
    int64_t lo, hi;
    for (int64_t t = 0, offset = 0; t < count && offset < end; offset += numel[t], t++)
        if (piece(start, end, offset, numel[t], &lo, &hi))
            step_one(p[t], g[t], m[t], v[t], c ? c[t] : NULL, k, (uint32_t)keys[2 * t], (uint32_t)keys[2 * t + 1],
                     lo, hi, mode);
}

/* The step of all the tensors in one call: [start, end) split over `threads` OpenMP threads (native.h's
 * thread_range). Built with OpenMP, this is torch's own thread pool (the libgomp torch loaded is the one this library
 * links), so it does not compete with torch's threads still spinning after the backward pass; without OpenMP, one
 * thread. */
void adamw_bf16_step(int64_t count, uint16_t *const *p, uint16_t *const *g, uint16_t *const *m,
                     uint16_t *const *v, uint16_t *const *c, const int64_t *numel, const int32_t *keys,
                     const adamw_bf16_coef_t *coef, comp_mode_t mode, int64_t start, int64_t end, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        if (thread_range(start, end, &lo, &hi))
            step_range(count, p, g, m, v, c, numel, keys, coef, lo, hi, mode);
    }
}
