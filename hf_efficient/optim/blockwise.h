/* The driver of the 8-bit families' kernels (adamw8bit_cpu.c, lion8bit_cpu.c): their step on fp32 or bf16 weights
 * and gradients with blockwise 8-bit moments (quant8.h's codec), one block of 256 elements at a time. A block's
 * moments are decoded into 1 KiB buffers (the absmax applied), then one pass reads the weight and gradient in place,
 * applies the family's update (its _kernel's operations in their order: with -ffp-contract=off every fp32 operation
 * rounds as torch's eager ops do), keeps each moment's running absmax and writes the weight (bf16: under the
 * compensation mode, as compensation.write); then each moment is encoded. A tensor's last, partial block is
 * zero-padded as eager pads it: its padding's moments are stepped with a zero weight and gradient.
 *
 * Why not inductor: its C++ for these kernels spends most of its vector operations on decoding and encoding (it
 * cannot look values up or read a float's exponent; docs/results/bench_step.md has the times); here a block's moments
 * stay in L1 between the passes its absmax needs, decoding looks values up, and encoding finds the decade from the
 * float's exponent.
 *
 * A family's kernel is its family_t and two lines (see lion8bit_cpu.c):
 *     static void range(const void *args, int64_t lo, int64_t hi) { blockwise_range(args, &FAMILY, lo, hi); }
 *     void x_step(<blockwise_t's fields>, int64_t start, int64_t end, int threads)
 *     { blockwise_step(range, (blockwise_t){...}, start, end, threads); }
 */
#ifndef HF_EFF_BLOCKWISE_H
#define HF_EFF_BLOCKWISE_H
#include <stdint.h>
#include <string.h>

#include "native.h"
#include "quant8.h"

/* The kernel's arguments, as Blockwise8bit.c_kernel declares them (its C signature, in order). */
typedef struct {
    int64_t count;
    void *const *p;          /* weights: fp32, or bf16 where bf16[t] */
    const void *const *g;    /* gradients, of the weights' dtype */
    uint32_t *const *codes;  /* codes[j * count + t]: moment j of tensor t, in quant8's in-memory layout */
    float *const *absmax;    /* absmax[j * count + t]: its absmaxes, one a block */
    const int64_t *numel;
    const int32_t *bf16;
    uint16_t *const *c;      /* each tensor's Kahan buffer, or NULL */
    const int32_t *keys;     /* each weight's noise key */
    comp_mode_t mode;
    const float *maps;       /* quant8.c_tables() */
    const float *coef;       /* the family's coefficient struct per tensor */
    const map_t *tables;     /* the maps' tables (blockwise_step builds them once a call) */
} blockwise_t;

/* Elements [0, valid) of a block from element `first` of its tensor (p, g, c at the block's first element), then its
 * padding up to BLOCK: s, the moments' values in and out; top, their running absmax_bits. */
ALWAYS_INLINE void block_pass(void *restrict p, const void *restrict g, uint16_t *restrict c,
                              float (*restrict s)[BLOCK], const float *scale, uint32_t *top, const float *k,
                              int64_t first,
                              const int64_t valid, int64_t n, uint32_t key, const family_t *f, const int bf16,
                              const comp_mode_t mode) {
    for (int e = 0; e < (int)valid; e++) { /* int: the noise index a 32-bit vector, not truncated 64-bit ones */
        float x[MAX_STATES];
        for (int j = 0; j < f->states; j++)
            x[j] = s[j][e] * scale[j]; /* quant8.unpack: decoded * absmax */
        const float p32 = load_f32(p, e, bf16), fresh = f->update(p32, load_f32(g, e, bf16), x, k, first + e, n);
        for (int j = 0; j < f->states; j++) {
            s[j][e] = x[j];
            top[j] = absmax_bits(top[j], x[j]);
        }
        if (bf16)
            ((uint16_t *)p)[e] = write_weight(p32, fresh, mode == KAHAN ? &c[e] : NULL,
                                              hash32(key, (uint32_t)first + (uint32_t)e), mode);
        else
            ((float *)p)[e] = fresh;
    }
    for (int e = (int)valid; e < BLOCK; e++) { /* zero-padded: a zero weight and gradient, the new weight dropped */
        float x[MAX_STATES];
        for (int j = 0; j < f->states; j++)
            x[j] = s[j][e] * scale[j];
        f->update(0.0f, 0.0f, x, k, first + e, n);
        for (int j = 0; j < f->states; j++) {
            s[j][e] = x[j];
            top[j] = absmax_bits(top[j], x[j]);
        }
    }
}

/* Block i of tensor t (`valid` of its elements in the tensor): decoded, stepped, encoded. */
ALWAYS_INLINE void block_step(const blockwise_t *a, const family_t *f, int64_t t, int64_t i, const int64_t valid,
                              const float *k, const int bf16, const comp_mode_t mode) {
    float s[MAX_STATES][BLOCK], scale[MAX_STATES];
    uint32_t top[MAX_STATES], *w[MAX_STATES];
    for (int j = 0; j < f->states; j++) {
        w[j] = a->codes[j * a->count + t] + i * WORDS;
        scale[j] = a->absmax[j * a->count + t][i];
        decode_block(w[j], &a->tables[f->is_signed[j] ? 0 : 1], s[j]);
        top[j] = 0;
    }
    const int64_t first = i * BLOCK;
    block_pass((char *)a->p[t] + first * (bf16 ? 2 : 4), (const char *)a->g[t] + first * (bf16 ? 2 : 4),
               bf16 && mode == KAHAN ? a->c[t] + first : NULL, s, scale, top, k, first, valid, a->numel[t],
               (uint32_t)a->keys[t], f, bf16, mode);
    for (int j = 0; j < f->states; j++)
        a->absmax[j * a->count + t][i] = store_block(s[j], top[j], &a->tables[f->is_signed[j] ? 0 : 1], w[j]);
}

/* Blocks [lo, hi) of tensor t, of one kind (constants where inlined: see with_kind; gradients share the weights'
 * dtype). Whole blocks with a constant length: no loop remainder to handle. */
ALWAYS_INLINE void blockwise_kind(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi,
                                  const int bf16, int g_bf16, const comp_mode_t mode) {
    const blockwise_t *a = args;
    float k[MAX_COEFS];
    memcpy(k, a->coef + t * f->coefs, f->coefs * sizeof(float)); /* a copy no store can alias: hoisted */
    const int64_t n = a->numel[t];
    (void)g_bf16;
    for (int64_t i = lo; i < hi; i++) {
        if ((i + 1) * BLOCK <= n)
            block_step(a, f, t, i, BLOCK, k, bf16, mode);
        else
            block_step(a, f, t, i, n - i * BLOCK, k, bf16, mode);
    }
}

ALWAYS_INLINE int blockwise_part(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi) {
    const blockwise_t *a = args;
    with_kind(blockwise_kind, args, f, t, lo, hi, a->bf16[t], a->bf16[t], a->mode);
    return 0;
}

/* Blocks [start, end) of the concatenation of the tensors' blocks (ceil(n / 256) for n elements), with family f: a
 * kernel's range function. */
ALWAYS_INLINE void blockwise_range(const void *args, const family_t *f, int64_t start, int64_t end) {
    const blockwise_t *a = args;
    walk(blockwise_part, args, f, a->count, a->numel, BLOCK, start, end);
}

/* The step of all the tensors in one call: blocks [start, end) split over `threads` (run_team), each piece by
 * `range`. */
static inline void blockwise_step(range_fn range, blockwise_t args, int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, args.maps);
    args.tables = tables;
    run_team(range, &args, start, end, threads);
}
#endif
