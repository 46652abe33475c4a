/* Test-only entry points over hf_efficient/optim/quant4.h, built by tests/test_quant4.py (with and without AVX-512). */
#include <stdint.h>

#include "quant4.h"

/* nb whole blocks of values x (128 each) into in-memory words (16 each) and scales. */
void q4_test_store(const float *x, int64_t nb, const float *tables, int is_signed, uint32_t *words, float *scales) {
    q4_tables_t t;
    q4_tables(&t, tables);
    for (int64_t b = 0; b < nb; b++)
        scales[b] = q4_store_block(x + b * Q4_BLOCK, &t, is_signed, words + b * Q4_WORDS);
}

/* nb blocks' decoded values from their words and scales. */
void q4_test_load(const uint32_t *words, const float *scales, int64_t nb, const float *tables, int is_signed,
                  float *out) {
    q4_tables_t t;
    q4_tables(&t, tables);
    for (int64_t b = 0; b < nb; b++)
        q4_decode_block(words + b * Q4_WORDS, scales[b], &t, is_signed, out + b * Q4_BLOCK);
}

/* 1 where this build took the AVX-512 paths. */
int q4_test_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
