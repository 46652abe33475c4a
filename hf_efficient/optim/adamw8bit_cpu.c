/* AdamW8bit's step on CPU for fp32 or bf16 weights and gradients: AdamW's update (adamw_update.h), driven by
 * blockwise.h (blocks of 256 elements, quant8.h's codec, threads, dtypes and compensation modes). coef: an
 * adamw_coef_t per tensor (adamw8bit._coefficients).
 */
#include <stdint.h>

#include "blockwise.h"
#include "adamw_update.h"

static void adamw8bit_range(const void *args, int64_t lo, int64_t hi) { blockwise_range(args, &ADAMW, lo, hi); }

/* Blocks [start, end) of the tensors' blocks, split over `threads`. */
void adamw8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *codes, float *const *absmax,
                    const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys,
                    comp_mode_t mode, const float *maps, const adamw_coef_t *coef, int64_t start, int64_t end,
                    int threads) {
    blockwise_step(adamw8bit_range, (blockwise_t){count, p, g, codes, absmax, numel, bf16, c, keys, mode, maps,
                                                  (const float *)coef, NULL}, start, end, threads);
}
