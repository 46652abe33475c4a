/* The driver of the kernels that step bf16 weights with fp32 state, element by element (_dispatch.Bf16WeightKernel:
 * adamw_cpu.c's adamw_step, lion8bit_cpu.c's lion_step): what compensation.step_in_fp32 does on fp32 copies, in one
 * pass with no copy. Per element: the weight (bf16) and gradient (fp32 or bf16) read as fp32, the family's update on
 * its state values, the state stored, the new weight written under the compensation mode as write_all writes it.
 *
 * A family's kernel is its family_t and two lines (see adamw_cpu.c):
 *     static void range(const void *args, int64_t lo, int64_t hi) { elementwise_range(args, &FAMILY, lo, hi); }
 *     void x_step(<elementwise_t's fields>, int64_t start, int64_t end, int threads)
 *     { elementwise_step(range, (elementwise_t){...}, start, end, threads); }
 */
#ifndef HF_EFF_ELEMENTWISE_H
#define HF_EFF_ELEMENTWISE_H
#include <stdint.h>
#include <string.h>

#include "native.h"

/* The kernel's arguments, as Bf16WeightKernel passes them (its C signature, in order). */
typedef struct {
    int64_t count;
    uint16_t *const *p;     /* bf16 weights */
    const void *const *g;   /* gradients: fp32, or bf16 where g_bf16[t] */
    float *const *states;   /* states[j * count + t]: state j of tensor t */
    uint16_t *const *c;     /* Kahan buffers (NULL unless mode is KAHAN) */
    const int64_t *numel;
    const int32_t *g_bf16;
    const int32_t *keys;    /* each weight's noise key */
    const float *coef;      /* the family's coefficient struct per tensor */
    comp_mode_t mode;
} elementwise_t;

_Static_assert(MAX_STATES == 2, "elementwise_loop takes a tensor's states as s0, s1");

/* Elements [lo, hi) of one tensor of n elements (s0, s1: its states, s1 unused with one; c: its Kahan buffer under KAHAN), k its
 * coefficients. Restrict parameters, not locals: GCC keeps a parameter's restrict through inlining, and with it the
 * loop needs no run-time overlap checks. */
ALWAYS_INLINE void elementwise_loop(uint16_t *restrict p, const void *restrict g, float *restrict s0,
                                    float *restrict s1, uint16_t *restrict c, uint32_t key, const float *k, int64_t n,
                                    int64_t lo, int64_t hi, const family_t *f, const int g_bf16,
                                    const comp_mode_t mode) {
    uint32_t idx = (uint32_t)lo; /* i's noise index: a 32-bit vector, not truncated 64-bit ones */
    for (int64_t i = lo; i < hi; i++, idx++) {
        float x[MAX_STATES] = {s0[i], f->states > 1 ? s1[i] : 0.0f};
        const float p32 = bf16_to_f32(p[i]), fresh = f->update(p32, load_f32(g, i, g_bf16), x, k, i, n);
        s0[i] = x[0];
        if (f->states > 1)
            s1[i] = x[1];
        p[i] = write_weight(p32, fresh, mode == KAHAN ? &c[i] : NULL, hash32(key, idx), mode);
    }
}

/* Elements [lo, hi) of tensor t, of one kind (constants where inlined: see with_kind; weights always bf16). */
ALWAYS_INLINE void elementwise_kind(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi,
                                    int p_bf16, const int g_bf16, const comp_mode_t mode) {
    const elementwise_t *a = args;
    float k[MAX_COEFS];
    memcpy(k, a->coef + t * f->coefs, f->coefs * sizeof(float)); /* a copy no store can alias: hoisted */
    (void)p_bf16;
    elementwise_loop(a->p[t], a->g[t], a->states[t], f->states > 1 ? a->states[a->count + t] : NULL,
                     mode == KAHAN ? a->c[t] : NULL, (uint32_t)a->keys[t], k, a->numel[t], lo, hi, f, g_bf16, mode);
}

ALWAYS_INLINE int elementwise_part(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi) {
    const elementwise_t *a = args;
    with_kind(elementwise_kind, args, f, t, lo, hi, 1, a->g_bf16[t], a->mode);
    return 0;
}

/* Elements [start, end) of the concatenation of the tensors, with family f: a kernel's range function. */
ALWAYS_INLINE void elementwise_range(const void *args, const family_t *f, int64_t start, int64_t end) {
    const elementwise_t *a = args;
    walk(elementwise_part, args, f, a->count, a->numel, 1, start, end);
}

/* The step of all the tensors in one call: [start, end) split over `threads` (run_team), each piece by `range`. */
static inline void elementwise_step(range_fn range, elementwise_t args, int64_t start, int64_t end, int threads) {
    run_team(range, &args, start, end, threads);
}
#endif
