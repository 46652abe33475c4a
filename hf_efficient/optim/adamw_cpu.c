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
 * The kernel is this update and its coefficients; elementwise.h drives it (threads, tensors, dtypes, modes).
 * coef: an adamw_coef_t per tensor (adamw._c_coefficients).
 */
#include <math.h>
#include <stdint.h>

#include "elementwise.h"

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

/* torch's fused AdamW on element i of n (s: exp_avg, exp_avg_sq); exp_avg_sq's multiply-add as torch's vectorized
 * body or, on each tensor's last n % 8 elements, as its scalar tail (see above). */
ALWAYS_INLINE float adamw_update(float p, float g, float *s, const void *coef, int64_t i, int64_t n) {
    const adamw_coef_t *k = coef;
    const float m = fmaf(k->lerp, g - s[0], k->toward_m != 0.0f ? s[0] : g);
    const float v = i < n - n % 8 ? fmaf(k->one_minus_beta2 * g, g, s[1] * k->beta2)
                                  : fmaf(s[1], k->beta2, (k->one_minus_beta2 * g) * g);
    s[0] = m;
    s[1] = v;
    return p * k->decay + (k->neg_step_size * m) / (sqrtf(v) / k->bias_correction2_sqrt + k->eps);
}

static const family_t ADAMW = {adamw_update, 2, sizeof(adamw_coef_t) / sizeof(float), {0}};

static void adamw_range(const void *args, int64_t start, int64_t end) { elementwise_range(args, &ADAMW, start, end); }

/* The step of all the tensors in one call (states: every exp_avg, then every exp_avg_sq), [start, end) split over
 * `threads` (see native.h's run_team). */
void adamw_step(int64_t count, uint16_t *const *p, const void *const *g, float *const *states, uint16_t *const *c,
                const int64_t *numel, const int32_t *g_bf16, const int32_t *keys, const adamw_coef_t *coef,
                comp_mode_t mode, int64_t start, int64_t end, int threads) {
    elementwise_step(adamw_range, (elementwise_t){count, p, g, states, c, numel, g_bf16, keys, (const float *)coef,
                                                  mode}, start, end, threads);
}
