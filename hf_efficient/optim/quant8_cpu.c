/* The 8-bit codec alone on CPU: quant8.pack and quant8.unpack of whole blocks, for state that no family's blockwise
 * kernel steps (Muon8bit's momentum: decoded whole before Newton-Schulz, encoded back after). quant8.h's own
 * decode_block and store_block, so the codes and values are the eager codec's bit for bit (the probe checks); the
 * eager codec's torch operations cost more than Newton-Schulz itself on a CPU thread.
 *
 * values: blocks * 256 floats (a tensor's elements, its last block zero-padded); words: blocks * 64 in-memory words;
 * absmax: one float per block; is_signed: the map (quant8's signed or unsigned); maps: quant8.c_tables().
 * Blocks [start, end) split over threads. quant8_encode_stochastic: quant8.pack with noise (the signed map, rounded
 * stochastically as quant8.stochastic_codes does; element i's noise hash32(key, offset + i)). */
#include <stdint.h>

#include "quant8.h"

typedef struct {
    float *values;
    uint32_t *words;
    float *absmax;
    const map_t *t;
    uint32_t key, offset; /* quant8_encode_stochastic's */
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

/* quant8.pack with noise of block b: nearest codes (encode_codes), each moved to the other code around its value with
 * probability |x - map(q)| / |map(other) - map(q)| (quant8.stochastic_codes, the same fp32 operations). */
static void encode_stochastic_range(const void *args, int64_t start, int64_t end) {
    const codec_args_t *a = args;
    const map_t *t = a->t;
    float x[BLOCK];
    uint32_t q[BLOCK];
    for (int64_t b = start; b < end; b++) {
        uint32_t top = 0;
        for (int e = 0; e < BLOCK; e++)
            top = absmax_bits(top, a->values[b * BLOCK + e]);
        float scale;
        memcpy(&scale, &top, 4);
        scale = block_scale(scale);
        const float inv = 1.0f / (scale > 0.0f ? scale : 1.0f);
        for (int e = 0; e < BLOCK; e++)
            x[e] = a->values[b * BLOCK + e] * inv;
        encode_codes(x, t, q);
        for (int e = 0; e < BLOCK; e++) {
            const float m = t->decoded[q[e]], d = x[e] - m;
            int other = (int)q[e] + (d > 0.0f) - (d < 0.0f);
            other = other < 0 ? 0 : (other > 255 ? 255 : other);
            const uint32_t noise = hash32(a->key, a->offset + (uint32_t)(b * BLOCK + e));
            const float uniform = (float)(noise >> 8) * 0x1p-24f;
            if (uniform * fabsf(t->decoded[other] - m) < fabsf(d))
                q[e] = (uint32_t)other;
        }
        uint32_t *w = a->words + b * WORDS;
        for (int j = 0; j < WORDS; j++)
            w[j] = (q[j] & 255u) | (q[WORDS + j] & 255u) << 8 | (q[2 * WORDS + j] & 255u) << 16 |
                   (q[3 * WORDS + j] & 255u) << 24;
        a->absmax[b] = scale;
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

/* quant8.pack(values, True, noise): the signed map, rounded stochastically; noise of element i: hash32(key, offset + i). */
void quant8_encode_stochastic(const float *values, uint32_t *words, float *absmax, const float *maps, int64_t key,
                              int64_t offset, int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
    codec_args_t args = {(float *)values, words, absmax, &tables[0], (uint32_t)key, (uint32_t)offset};
    run_team(encode_stochastic_range, &args, start, end, threads);
}

/* quant8.unpack: words, absmax -> values. */
void quant8_decode(float *values, const uint32_t *words, const float *absmax, int64_t is_signed, const float *maps,
                   int64_t start, int64_t end, int threads) {
    map_t tables[2];
    quant8_maps(tables, maps);
    run_team(decode_range, &(codec_args_t){values, (uint32_t *)words, (float *)absmax, &tables[is_signed ? 0 : 1]},
             start, end, threads);
}
