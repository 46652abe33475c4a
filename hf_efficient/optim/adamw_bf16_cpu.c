/* AdamWBF16's step on CPU for bf16 weights: the operations of adamw_bf16.py's kernels, in their order,
 * one element at a time in plain C that the compiler vectorizes (built with -O3 -ffp-contract=off, so
 * no multiply-add is fused and every fp32 operation rounds as torch's eager ops do).
 *
 * Why not inductor: its C++ for this kernel is compute-bound on the hash and the stochastic rounding (it
 * scalarizes bit casts); this loop is close to memory-bound, moving 18 bytes per parameter against fused fp32
 * AdamW's 28 (times: docs/results/bench_step.md).
 *
 * bf16 values travel as uint16_t. coef: an adamw_bf16_coef_t per call (adamw_bf16._coefficients). An element's
 * index in its tensor numbers its noise, as torch.arange does in the Python kernels. Its loop is its own (moments
 * stored in bf16, the second one rounded as the Python kernels round it: not elementwise.h's fp32 state); native.h's
 * run_team, walk and with_kind drive it.
 */
#include <math.h>
#include <stdint.h>

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

/* The kernel's arguments, in its C signature's order. */
typedef struct {
    int64_t count;
    uint16_t *const *p, *const *g, *const *m, *const *v, *const *c; /* c: NULL unless mode is KAHAN */
    const int64_t *numel;
    const int32_t *keys; /* key and weight key of each tensor */
    const adamw_bf16_coef_t *k;
    comp_mode_t mode;
} args_t;

/* Elements [lo, hi) of one tensor, with the mode a constant where it is inlined: a branch on it inside the loop
 * would stop the vectorizer. key: the second moment's noise key; weight_key: the weight's. Restrict parameters (see
 * elementwise.h's elementwise_loop). */
ALWAYS_INLINE void step_loop(uint16_t *restrict p, const uint16_t *restrict g, uint16_t *restrict m,
                             uint16_t *restrict v, uint16_t *restrict c, const adamw_bf16_coef_t *k, uint32_t key,
                             uint32_t weight_key, int64_t lo, int64_t hi, const comp_mode_t mode) {
    const float b1 = k->beta1, omb1 = k->one_minus_beta1, b2 = k->beta2, omb2 = k->one_minus_beta2;
    const float inv_bc2 = k->inv_bias_correction2_sqrt, eps = k->eps, neg_lr_wd = k->neg_lr_wd;
    const float step_size = k->step_size;
    uint32_t idx = (uint32_t)lo; /* i's noise index: a 32-bit vector, not truncated 64-bit ones */
    for (int64_t i = lo; i < hi; i++, idx++) {
        float p32 = bf16_to_f32(p[i]);
        float g32 = bf16_to_f32(g[i]);
        float m32 = bf16_to_f32(m[i]) * b1 + g32 * omb1;
        float v32 = clamp_max(bf16_to_f32(v[i]) * b2 + (g32 * g32) * omb2, BF16_MAX); /* see .py */
        m[i] = f32_to_bf16(m32);
        v[i] = mode == NONE ? f32_to_bf16(v32) : round_stochastic(v32, hash32(key, idx));
        float denom = sqrtf(v32) * inv_bc2 + eps;
        float update = p32 * neg_lr_wd - (m32 / denom) * step_size;
        p[i] = write_bf16(p32, update, mode == KAHAN ? &c[i] : NULL, hash32(weight_key, idx), mode);
    }
}

/* Elements [lo, hi) of tensor t, of one kind (see with_kind: weights and gradients always bf16). */
ALWAYS_INLINE void step_kind(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi, int p_bf16,
                             int g_bf16, const comp_mode_t mode) {
    const args_t *a = args;
    (void)f, (void)p_bf16, (void)g_bf16; /* a kernel of its own */
    step_loop(a->p[t], a->g[t], a->m[t], a->v[t], mode == KAHAN ? a->c[t] : NULL, a->k, (uint32_t)a->keys[2 * t],
              (uint32_t)a->keys[2 * t + 1], lo, hi, mode);
}

ALWAYS_INLINE int step_part(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi) {
    with_kind(step_kind, args, f, t, lo, hi, 1, 1, ((const args_t *)args)->mode);
    return 0;
}

static void step_range(const void *args, int64_t start, int64_t end) {
    walk(step_part, args, NULL, ((const args_t *)args)->count, ((const args_t *)args)->numel, 1, start, end);
}

/* The step of all the tensors in one call (arrays of pointers; c may be NULL unless mode is KAHAN; keys: key and
 * weight key of each tensor): [start, end) split over `threads` OpenMP threads (native.h's run_team). Built with
 * OpenMP, this is torch's own thread pool (the libgomp torch loaded is the one this library links), so it does not
 * compete with torch's threads still spinning after the backward pass; without OpenMP, one thread. */
void adamw_bf16_step(int64_t count, uint16_t *const *p, uint16_t *const *g, uint16_t *const *m,
                     uint16_t *const *v, uint16_t *const *c, const int64_t *numel, const int32_t *keys,
                     const adamw_bf16_coef_t *coef, comp_mode_t mode, int64_t start, int64_t end, int threads) {
    run_team(step_range, &(args_t){count, p, g, m, v, c, numel, keys, coef, mode}, start, end, threads);
}
