/* Lion's steps on CPU, one update (lion8bit._kernel's and lion8bit.lion's operations, in their order) driven twice:
 * lion8bit_step, blockwise 8-bit momenta on fp32 or bf16 weights (blockwise.h), and lion_step, fp32 momenta on bf16
 * weights (small tensors, and those named to keep fp32 state: elementwise.h), what lion8bit.lion does on CPU (its
 * torch operations, then compensation.write_all's write) in one pass. coef: a lion_coef_t per tensor
 * (lion8bit._c_coefficients).
 */
#include <stdint.h>

#include "blockwise.h"
#include "elementwise.h"

/* lion8bit._kernel's scalars, in the order lion8bit._c_coefficients writes them. */
typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float decay; /* 1 - lr * wd */
    float lr;
} lion_coef_t;
_Static_assert(sizeof(lion_coef_t) == 6 * sizeof(float), "lion8bit._c_coefficients writes 6 floats per tensor");

/* Lion on one element: the new weight from the momentum s[0] (updated in place). sign as torch.sign: 0 for 0, NaN. */
ALWAYS_INLINE float lion_update(float p, float g, float *s, const void *coef, int64_t i, int64_t n) {
    const lion_coef_t *k = coef;
    const float u = s[0] * k->beta1 + g * k->one_minus_beta1;
    s[0] = s[0] * k->beta2 + g * k->one_minus_beta2;
    return p * k->decay - ((float)(u > 0.0f) - (float)(u < 0.0f)) * k->lr;
}

static const family_t LION = {lion_update, 1, sizeof(lion_coef_t) / sizeof(float), {1}};

static void lion8bit_range(const void *args, int64_t lo, int64_t hi) { blockwise_range(args, &LION, lo, hi); }

static void lion_range(const void *args, int64_t lo, int64_t hi) { elementwise_range(args, &LION, lo, hi); }

/* Blocks [start, end) of the tensors' blocks, split over `threads`. */
void lion8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *codes, float *const *absmax,
                   const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys,
                   comp_mode_t mode, const float *maps, const lion_coef_t *coef, int64_t start, int64_t end,
                   int threads) {
    blockwise_step(lion8bit_range, (blockwise_t){count, p, g, codes, absmax, numel, bf16, c, keys, mode, maps,
                                                 (const float *)coef, NULL}, start, end, threads);
}

/* Elements [start, end) of the tensors (states: their momenta), split over `threads`. */
void lion_step(int64_t count, uint16_t *const *p, const void *const *g, float *const *states, uint16_t *const *c,
               const int64_t *numel, const int32_t *g_bf16, const int32_t *keys, const lion_coef_t *coef,
               comp_mode_t mode, int64_t start, int64_t end, int threads) {
    elementwise_step(lion_range, (elementwise_t){count, p, g, states, c, numel, g_bf16, keys, (const float *)coef,
                                                 mode}, start, end, threads);
}
