/* Shared by this package's C kernels: run BODY on `threads` disjoint pieces of [start, end), each a multiple of
 * 64 elements (cache lines of every dtype) but the last, as `range_start` / `range_end`. With OpenMP the pieces
 * run on its threads; without it, the whole range runs here. */
#ifndef HF_EFF_NATIVE_PARALLEL_H
#define HF_EFF_NATIVE_PARALLEL_H
#include <stdint.h>
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
