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

/* The first tensor in [start, end) holding an inf, a NaN or (fp32, bf16) |x| >= 2**64, or -1. */
static int64_t scan_range(int64_t count, const void *const *data, const int64_t *numel, const int32_t *kind,
                          int64_t start, int64_t end) {
    int64_t lo, hi;
    for (int64_t t = 0, offset = 0; t < count && offset < end; offset += numel[t], t++)
        if (piece(start, end, offset, numel[t], &lo, &hi) && any_nonfinite(data[t], kind[t], lo, hi))
            return t;
    return -1;
}

/* The index of the first of `count` tensors that holds such a value, or -1; [start, end) split over threads. */
int64_t first_nonfinite(int64_t count, const void *const *data, const int64_t *numel, const int32_t *kind,
                        int64_t start, int64_t end, int threads) {
    int64_t first = -1;
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi, found = -1;
        if (thread_range(start, end, &lo, &hi))
            found = scan_range(count, data, numel, kind, lo, hi);
        if (found >= 0) {
#pragma omp critical
            if (first < 0 || found < first)
                first = found;
        }
    }
    return first;
}
