/* guard.first_nonfinite's scan on CPU: which gradient holds an inf or NaN. One pass over each gradient's bits
 * (exponent all ones), every gradient of the step in one call on torch's threads: it costs what reading the
 * gradients costs, where a torch reduction per tensor paid a call and a cascade sum for each.
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
            bad |= (x[i] & 0x7F800000u) == 0x7F800000u;
    } else {
        const uint16_t *x = data;
        const uint16_t mask = kind == 1 ? 0x7F80u : 0x7C00u;
        for (int64_t i = a; i < b; i++)
            bad |= (x[i] & mask) == mask;
    }
    return bad;
}

/* The first tensor in [start, end) holding an inf or NaN, or -1. */
static int64_t scan_range(int64_t count, const void *const *data, const int64_t *numel, const int32_t *kind,
                          int64_t start, int64_t end) {
    FOR_EACH_PIECE(count, numel[t], start, end, {
        if (any_nonfinite(data[t], kind[t], piece_start, piece_end))
            return t;
    });
    return -1;
}

/* The index of the first of `count` tensors that holds an inf or NaN, or -1; [start, end) split over threads. */
int64_t first_nonfinite(int64_t count, const void *const *data, const int64_t *numel, const int32_t *kind,
                        int64_t start, int64_t end, int threads) {
    int64_t first = -1;
    PARALLEL_RANGES(start, end, threads, {
        int64_t found = scan_range(count, data, numel, kind, range_start, range_end);
        if (found >= 0) {
            _Pragma("omp critical") if (first < 0 || found < first) first = found;
        }
    });
    return first;
}
