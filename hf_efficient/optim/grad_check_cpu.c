/* guard.first_nonfinite's scan on CPU: which gradient holds an inf or NaN, or (fp32, bf16) a finite value whose
 * square overflows fp32 (|x| >= 2**64: the step's g * g would be inf and poison the second moment). One pass over
 * each gradient's bits (|x|'s bit pattern against inf's, or 2**64's: the order of non-negative floats), every
 * gradient of the step in one call on torch's threads: it costs what reading the gradients costs, where a torch
 * reduction per tensor paid a call and a cascade sum for each. fp16 never reaches 2**64 (its largest is 65504).
 *
 * kind: 0 float32, 1 bfloat16, 2 float16. Elements [start, end) of the tensors' concatenation.
 */
#include <stdint.h>

#include "native.h"

static int any_nonfinite(const void *data, int kind, int64_t a, int64_t b) {
    int bad = 0;
    if (kind == 0) {
        const uint32_t *x = data;
        for (int64_t i = a; i < b; i++)
            bad |= (x[i] & 0x7FFFFFFFu) >= 0x5F800000u; /* 2**64 */
    } else {
        const uint16_t *x = data;
        const uint16_t limit = kind == 1 ? 0x5F80u : 0x7C00u; /* bf16 2**64; fp16 inf */
        for (int64_t i = a; i < b; i++)
            bad |= (x[i] & 0x7FFFu) >= limit;
    }
    return bad;
}

typedef struct {
    int64_t count;
    const void *const *data;
    const int64_t *numel;
    const int32_t *kind;
    int64_t *first; /* the answer, shared by the team */
} args_t;

static int scan_part(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi) {
    (void)f;
    return any_nonfinite(((const args_t *)args)->data[t], ((const args_t *)args)->kind[t], lo, hi);
}

/* This thread's first such tensor in [start, end), kept where it comes before the others' (run_team's range). */
static void scan_range(const void *args, int64_t start, int64_t end) {
    const args_t *a = args;
    const int64_t found = walk(scan_part, args, NULL, a->count, a->numel, 1, start, end);
    if (found >= 0) {
#pragma omp critical
        if (*a->first < 0 || found < *a->first)
            *a->first = found;
    }
}

/* The index of the first of `count` tensors that holds such a value, or -1; [start, end) split over threads. */
int64_t first_nonfinite(int64_t count, const void *const *data, const int64_t *numel, const int32_t *kind,
                        int64_t start, int64_t end, int threads) {
    int64_t first = -1;
    run_team(scan_range, &(args_t){count, data, numel, kind, &first}, start, end, threads);
    return first;
}
