/* The 8-bit codec alone on CPU: quant8.pack and quant8.unpack of whole blocks, for state that no family's blockwise
 * kernel steps (Muon8bit's momentum: decoded whole before Newton-Schulz, encoded back after). quant8.h's own
 * decode_block and store_block, so the codes and values are the eager codec's bit for bit (the probe checks); the
 * eager codec's torch operations cost more than Newton-Schulz itself on a CPU thread.
 *
 * values: blocks * 256 floats (a tensor's elements, its last block zero-padded); words: blocks * 64 in-memory words;
 * absmax: one float per block; is_signed: the map (quant8's signed or unsigned); maps: quant8.c_tables().
 * Blocks [start, end) split over threads. */
#include <stdint.h>

#include "quant8.h"

typedef struct {
    float *values;
    uint32_t *words;
    float *absmax;
    const map_t *t;
} codec_args_t;

static void encode_range(const void *args, int64_t start, int64_t end) {
    const codec_args_t *a = args;
    float x[BLOCK];
    for (int64_t b = start; b < end; b++) {
        uint32_t top = 0;
        for (int e = 0; e < BLOCK; e++) {
            x[e] = a->values[b * BLOCK + e];
            top = absmax_bits(top, x[e]);
        }
        a->absmax[b] = store_block(x, top, a->t, a->words + b * WORDS);
    }
}

static void decode_range(const void *args, int64_t start, int64_t end) {
    const codec_args_t *a = args;
    for (int64_t b = start; b < end; b++) {
        float *out = a->values + b * BLOCK;
        decode_block(a->words + b * WORDS, a->t, out);
        for (int e = 0; e < BLOCK; e++) /* quant8.unpack's decoded * scale */
            out[e] *= a->absmax[b];
    }
}

/* quant8.pack: values -> words, absmax (values are read, not changed). */
void quant8_encode(const float *values, uint32_t *words, float *absmax, int64_t is_signed, const float *maps,
                   int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
    run_team(encode_range, &(codec_args_t){(float *)values, words, absmax, &tables[is_signed ? 0 : 1]}, start, end,
             threads);
}

/* quant8.unpack: words, absmax -> values. */
void quant8_decode(float *values, const uint32_t *words, const float *absmax, int64_t is_signed, const float *maps,
                   int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
    run_team(decode_range, &(codec_args_t){values, (uint32_t *)words, (float *)absmax, &tables[is_signed ? 0 : 1]},
             start, end, threads);
}
