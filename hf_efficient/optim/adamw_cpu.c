/* AdamW with fp32 moments on bf16 weights, on CPU: what adamw.adamw_fp32_state does there (torch's fused CPU AdamW
 * on an fp32 copy of the weights, then compensation.write_all) in one pass, with no copy. Per element, torch's
 * fused step (aten's FusedAdamKernel.cpp, AdamW mode) in its order and roundings: the exp_avg lerp as its one
 * multiply-add, exp_avg_sq's sum as the multiply-add torch's x86 build compiles it to: fma(c * g, g, v * beta2) on
 * its vectors, fma(v, beta2, c * g * g) on its scalar tail, each tensor's last numel % 8 elements (so with AVX-512
 * and with AVX2: the same bits as torch 2.13, checked in the tests); then the new weight written under compensation
 * `mode` as write_all writes it (native.h's write_bf16; `none` rounds the new value itself).
 *
 * Why: the torch path copies every weight to fp32 and back. For hf_eff_adamw on a bf16 model that doubles the
 * whole step's traffic; for the biases and norms beside 8-bit state it is ~100 small operations a step, each with
 * its fixed cost (times: docs/results/bench_step.md).
 *
 * coef: an adamw_coef_t per tensor (adamw._c_coefficients). Gradients fp32, or bf16 where g_bf16[t]. keys: each
 * tensor's weight noise key.
 */
#include <math.h>
#include <stdint.h>

#include "native.h"

/* torch's fused step's scalars, in the order adamw._c_coefficients writes them. */
typedef struct {
    float lerp;     /* 1 - beta1, or -beta1 where 1 - beta1 >= 0.5, as torch's lerp */
    float toward_m; /* 1 if lerp weights the gradient's side (1 - beta1 < 0.5) else 0 */
    float beta2, one_minus_beta2;
    float bias_correction2_sqrt; /* sqrt(1 - beta2^t): torch divides by it */
    float eps;
    float decay;         /* 1 - lr * wd */
    float neg_step_size; /* -lr / (1 - beta1^t) */
} adamw_coef_t;
_Static_assert(sizeof(adamw_coef_t) == 8 * sizeof(float), "adamw._c_coefficients writes 8 floats per tensor");

/* Elements [start, end) of one tensor, with the gradient's dtype and the mode constants where it is inlined: a branch
 * on either inside the loop would stop the vectorizer. body: the first element of the scalar tail (see above). */
ALWAYS_INLINE void step_loop(uint16_t *restrict p, const void *g, float *restrict m, float *restrict v,
                             uint16_t *restrict c, uint32_t key, const adamw_coef_t *k, int64_t body, int64_t start,
                             int64_t end, const int g_bf16, const comp_mode_t mode) {
    const float lerp = k->lerp, b2 = k->beta2, omb2 = k->one_minus_beta2, bc2_sqrt = k->bias_correction2_sqrt;
    const float eps = k->eps, decay = k->decay, neg_step = k->neg_step_size;
    const int toward_m = k->toward_m != 0.0f;
    for (int64_t i = start; i < end; i++) {
        float p32 = bf16_to_f32(p[i]), g32 = load_f32(g, i, g_bf16);
        float m32 = m[i];
        float mk = fmaf(lerp, g32 - m32, toward_m ? m32 : g32);
        float vk = i < body ? fmaf(omb2 * g32, g32, v[i] * b2) : fmaf(v[i], b2, (omb2 * g32) * g32);
        m[i] = mk;
        v[i] = vk;
        float fresh = p32 * decay + (neg_step * mk) / (sqrtf(vk) / bc2_sqrt + eps);
        p[i] = write_weight(p32, fresh, c, key, i, mode);
    }
}

static void step_one(uint16_t *restrict p, const void *g, int g_bf16, float *restrict m, float *restrict v,
                     uint16_t *restrict c, int32_t key, const adamw_coef_t *k, comp_mode_t mode, int64_t body,
                     int64_t start, int64_t end) {
    const uint32_t u = (uint32_t)key;
    if (g_bf16) {
        if (mode == KAHAN)
            step_loop(p, g, m, v, c, u, k, body, start, end, 1, KAHAN);
        else if (mode == STOCHASTIC)
            step_loop(p, g, m, v, c, u, k, body, start, end, 1, STOCHASTIC);
        else
            step_loop(p, g, m, v, c, u, k, body, start, end, 1, NONE);
    } else {
        if (mode == KAHAN)
            step_loop(p, g, m, v, c, u, k, body, start, end, 0, KAHAN);
        else if (mode == STOCHASTIC)
            step_loop(p, g, m, v, c, u, k, body, start, end, 0, STOCHASTIC);
        else
            step_loop(p, g, m, v, c, u, k, body, start, end, 0, NONE);
    }
}

/* Elements [start, end) of the concatenation of `count` tensors (c: Kahan buffers, NULL unless mode is KAHAN). */
static void step_range(int64_t count, uint16_t *const *p, const void *const *g, float *const *states,
                       uint16_t *const *c, const int64_t *numel, const int32_t *g_bf16, const int32_t *keys,
                       const adamw_coef_t *coef, comp_mode_t mode, int64_t start, int64_t end) {
    int64_t lo, hi;
    for (int64_t t = 0, offset = 0; t < count && offset < end; offset += numel[t], t++)
        if (piece(start, end, offset, numel[t], &lo, &hi))
            step_one(p[t], g[t], g_bf16[t], states[t], states[count + t], c ? c[t] : NULL, keys[t], &coef[t], mode,
                     numel[t] - numel[t] % 8, lo, hi);
}

/* The step of all the tensors in one call (states: every exp_avg, then every exp_avg_sq): [start, end) split over
 * `threads` (see native.h's thread_range). */
void adamw_step(int64_t count, uint16_t *const *p, const void *const *g, float *const *states, uint16_t *const *c,
                const int64_t *numel, const int32_t *g_bf16, const int32_t *keys, const adamw_coef_t *coef,
                comp_mode_t mode, int64_t start, int64_t end, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        if (thread_range(start, end, &lo, &hi))
            step_range(count, p, g, states, c, numel, g_bf16, keys, coef, mode, lo, hi);
    }
}
