/* AdamW with fp32 moments on bf16 weights, on CPU: what adamw.adamw_fp32_state does there (torch's fused CPU AdamW
 * on an fp32 copy of the weights, then compensation.write_all) in one pass, with no copy. Per element, torch's
 * fused step (aten's FusedAdamKernel.cpp, AdamW mode) in its order and roundings: the exp_avg lerp as its one
 * multiply-add, exp_avg_sq's sum as the multiply-add torch's x86 build compiles it to: fma(c * g, g, v * beta2) on
 * its vectors, fma(v, beta2, c * g * g) on its scalar tail, each tensor's last numel % 8 elements (so with AVX-512
 * and with AVX2: the same bits as torch 2.13, checked in the tests); then the new weight written under compensation
 * `mode` as write_all writes it (native.h's write_bf16; `none` rounds the new value itself).
 *
 * Why: the torch path copies every weight to fp32 and back. For hf_eff_adamw on a bf16 model that is the whole
 * step's traffic doubled (28M parameters: 7.5 ms stochastic, 9.2 ms Kahan here, ~1x torch's fused fp32 AdamW); for
 * the 32 biases and norms of 4 BERT layers beside 8-bit state (0.2% of the parameters) it was ~100 small operations,
 * 0.74 ms of every step (0.31 ms here).
 *
 * coef, 8 per tensor: lerp coefficient (1 - beta1, or -beta1 where 1 - beta1 >= 0.5, as torch's lerp), 1 if that
 * coefficient weights the gradient's side (1 - beta1 < 0.5) else 0, beta2, 1 - beta2, sqrt(1 - beta2^t), eps,
 * 1 - lr * wd, -lr / (1 - beta1^t). Gradients fp32, or bf16 where g_bf16[t]. keys: each tensor's weight noise key.
 */
#include <math.h>
#include <stdint.h>

#include "native.h"

static void step_one(uint16_t *restrict p, const void *g, int g_bf16, float *restrict m, float *restrict v,
                     uint16_t *restrict c, int32_t key, const float *coef, int mode, int64_t body, int64_t start,
                     int64_t end) {
    const float lerp = coef[0], b2 = coef[2], omb2 = coef[3], bc2_sqrt = coef[4], eps = coef[5];
    const float decay = coef[6], neg_step = coef[7];
    const int toward_m = coef[1] != 0.0f;
    BF16_WEIGHT_LOOPS(p, g, g_bf16, c, key, mode, start, end, {
        float m32 = m[i];
        float mk = fmaf(lerp, g32 - m32, toward_m ? m32 : g32);
        float vk = i < body ? fmaf(omb2 * g32, g32, v[i] * b2) : fmaf(v[i], b2, (omb2 * g32) * g32);
        m[i] = mk;
        v[i] = vk;
        fresh = p32 * decay + (neg_step * mk) / (sqrtf(vk) / bc2_sqrt + eps);
    })
}

/* Elements [start, end) of the concatenation of `count` tensors (c: Kahan buffers, NULL unless mode is 0). */
static void step_range(int64_t count, uint16_t *const *p, const void *const *g, float *const *states,
                       uint16_t *const *c, const int64_t *numel, const int32_t *g_bf16, const int32_t *keys,
                       const float *coef, int mode, int64_t start, int64_t end) {
    FOR_EACH_PIECE(count, numel[t], start, end,
                   step_one(p[t], g[t], g_bf16[t], states[t], states[count + t], c ? c[t] : NULL, keys[t],
                            coef + 8 * t, mode, numel[t] - numel[t] % 8, piece_start, piece_end));
}

/* The step of all the tensors in one call (states: every exp_avg, then every exp_avg_sq): [start, end) split over
 * `threads` (see native.h). */
void adamw_step(int64_t count, uint16_t *const *p, const void *const *g, float *const *states, uint16_t *const *c,
                const int64_t *numel, const int32_t *g_bf16, const int32_t *keys, const float *coef, int mode,
                int64_t start, int64_t end, int threads) {
    PARALLEL_RANGES(start, end, threads,
                    step_range(count, p, g, states, c, numel, g_bf16, keys, coef, mode, range_start, range_end));
}
