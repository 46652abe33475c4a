/* AdamW8bit's step on CPU for fp32 or bf16 weights and gradients: adamw8bit._kernel's update, driven by blockwise.h
 * (blocks of 256 elements, quant8.h's codec, threads, dtypes and compensation modes). coef: an adamw8bit_coef_t per
 * tensor (adamw8bit._coefficients).
 */
#include <math.h>
#include <stdint.h>

#include "blockwise.h"

/* adamw8bit._kernel's scalars, in the order adamw8bit._coefficients writes them. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float inv_bias_correction2_sqrt; /* 1 / sqrt(1 - beta2^t) */
    float eps;
    float decay;     /* 1 - lr * wd */
    float step_size; /* lr / (1 - beta1^t) */
} adamw8bit_coef_t;
_Static_assert(sizeof(adamw8bit_coef_t) == 8 * sizeof(float), "adamw8bit._coefficients writes 8 floats per tensor");

/* AdamW on one element: the new weight from the moments s[0], s[1] (updated in place); v clamped to fp32's range (see
 * adamw8bit._kernel; m, a convex combination, needs none). */
ALWAYS_INLINE float adamw8bit_update(float p, float g, float *s, const void *coef, int64_t i, int64_t n) {
    const adamw8bit_coef_t *k = coef;
    s[0] = s[0] * k->beta1 + g * k->one_minus_beta1;
    s[1] = clamp_max(s[1] * k->beta2 + (g * g) * k->one_minus_beta2, F32_MAX);
    return p * k->decay - (s[0] / (sqrtf(s[1]) * k->inv_bias_correction2_sqrt + k->eps)) * k->step_size;
}

static const family_t ADAMW8BIT = {adamw8bit_update, 2, sizeof(adamw8bit_coef_t) / sizeof(float), {1, 0}};

static void adamw8bit_range(const void *args, int64_t lo, int64_t hi) { blockwise_range(args, &ADAMW8BIT, lo, hi); }

/* Blocks [start, end) of the tensors' blocks, split over `threads`. */
void adamw8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *codes, float *const *absmax,
                    const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys,
                    comp_mode_t mode, const float *maps, const adamw8bit_coef_t *coef, int64_t start, int64_t end,
                    int threads) {
    blockwise_step(adamw8bit_range, (blockwise_t){count, p, g, codes, absmax, numel, bf16, c, keys, mode, maps,
                                                  (const float *)coef, NULL}, start, end, threads);
}
