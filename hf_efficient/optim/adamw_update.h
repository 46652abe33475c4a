/* AdamW's update of one element for the blockwise kernels, written once: adamw8bit_cpu.c (quant8.h's codec) and
 * adamw4bit_cpu.c (quant4.h's) hand it to blockwise.h. adamw8bit.adamw_update's operations in their order; its
 * scalars as adamw8bit._coefficients writes them (a struct per tensor).
 */
#ifndef HF_EFF_ADAMW_UPDATE_H
#define HF_EFF_ADAMW_UPDATE_H
#include <math.h>
#include <stdint.h>

#include "native.h"

/* adamw8bit._coefficients' scalars, in its order. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float inv_bias_correction2_sqrt; /* 1 / sqrt(1 - beta2^t) */
    float eps;
    float decay;     /* 1 - lr * wd */
    float step_size; /* lr / (1 - beta1^t) */
} adamw_coef_t;
_Static_assert(sizeof(adamw_coef_t) == 8 * sizeof(float), "adamw8bit._coefficients writes 8 floats per tensor");

/* AdamW on one element: the new weight from the moments s[0], s[1] (updated in place); v clamped to fp32's range (see
 * adamw8bit.adamw_update; m, a convex combination, needs none). */
ALWAYS_INLINE float adamw_update(float p, float g, float *s, const void *coef, int64_t i, int64_t n) {
    const adamw_coef_t *k = coef;
    (void)i, (void)n;
    s[0] = s[0] * k->beta1 + g * k->one_minus_beta1;
    s[1] = clamp_max(s[1] * k->beta2 + (g * g) * k->one_minus_beta2, F32_MAX);
    return p * k->decay - (s[0] / (sqrtf(s[1]) * k->inv_bias_correction2_sqrt + k->eps)) * k->step_size;
}

/* Its family_t: two moments, the first signed. */
static const family_t ADAMW = {adamw_update, 2, sizeof(adamw_coef_t) / sizeof(float), {1, 0}};
#endif
