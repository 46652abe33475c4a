/* Shared by this package's C kernels: bf16 conversions as torch's, the tensors a range of their concatenation
 * covers, and the split of a range over threads. */
#ifndef HF_EFF_NATIVE_H
#define HF_EFF_NATIVE_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Round to nearest even, as torch, but with no NaN test: every NaN here is a quieted bf16 NaN (low 16 bits
 * zero) or the CPU's default NaN, which this rounding keeps NaN (torch's test only picks the payload, and its
 * own vectorized and scalar conversions disagree on that). 10% of the bf16 kernel's time on one core. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* BODY for each tensor t among `count` whose items [piece_start, piece_end), numbered within t, fall in
 * [start, end) of the tensors' concatenation; `items` is an expression of t: how many items tensor t has. */
#define FOR_EACH_PIECE(count, items, start, end, BODY)                                                    \
    for (int64_t t = 0, offset_ = 0; t < (count) && offset_ < (end); offset_ += (items), t++) {           \
        int64_t piece_start = (start) > offset_ ? (start) - offset_ : 0;                                  \
        int64_t piece_end = (end) - offset_ < (items) ? (end) - offset_ : (items);                        \
        if (piece_start < piece_end) BODY;                                                                \
    }

/* Run BODY on `threads` disjoint pieces of [start, end), each a multiple of 64 items (cache lines of every
 * dtype) but the last, as `range_start` / `range_end`. With OpenMP the pieces run on its threads; without it,
 * the whole range runs here. */
#ifdef _OPENMP
#include <omp.h>
#define PARALLEL_RANGES(start, end, threads, BODY)                                                        \
    do {                                                                                                  \
        int64_t per_ = (((end) - (start)) / (threads) + 63) / 64 * 64;                                    \
        _Pragma("omp parallel num_threads(threads)") {                                                    \
            int64_t range_start = (start) + per_ * omp_get_thread_num();                                  \
            int64_t range_end = range_start + per_ < (end) ? range_start + per_ : (end);                  \
            if (range_start < range_end) BODY;                                                            \
        }                                                                                                 \
    } while (0)
#else
#define PARALLEL_RANGES(start, end, threads, BODY)                                                        \
    do {                                                                                                  \
        int64_t range_start = (start), range_end = (end);                                                 \
        (void)(threads);                                                                                  \
        BODY;                                                                                             \
    } while (0)
#endif
#endif
