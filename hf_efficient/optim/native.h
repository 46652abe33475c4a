/* Shared by this package's C kernels: bf16 conversions as torch's, the compensated write of a bf16 weight (and the
 * loops of a step with fp32 state around it), the tensors a range of their concatenation covers, the split of a
 * range over threads, and the clamps that keep moments finite. */
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

/* compensation.hash_noise: the noise of element idx under key (murmur3 fmix32 of a counter). */
static inline uint32_t hash32(uint32_t key, uint32_t idx) {
    uint32_t h = idx * 0x9E3779B1u + key;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

/* compensation.round_stochastic to bf16: NaNs stay NaN, as in f32_to_bf16. */
static inline uint16_t round_stochastic(float x, uint32_t noise) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (uint16_t)((b + (noise >> 16)) >> 16);
}

/* compensation.write for a bf16 weight: p32 + delta under mode 0 (kahan: *c carries what the rounded weight did not
 * absorb), 1 (stochastic, with `noise`) or 2 (nearest). Inlined with a constant mode, the other branches vanish. */
static inline uint16_t write_bf16(float p32, float delta, uint16_t *c, uint32_t noise, int mode) {
    if (mode == 0) {
        float y = delta + bf16_to_f32(*c);
        uint16_t fresh = f32_to_bf16(p32 + y);
        *c = f32_to_bf16(y - (bf16_to_f32(fresh) - p32));
        return fresh;
    }
    if (mode == 1)
        return round_stochastic(p32 + delta, noise);
    return f32_to_bf16(p32 + delta);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The vector twins of the conversions, hash and writes above, 16 elements at a time: same integer arithmetic, same
 * results (the fused kernels' registers never pass through a buffer). */
static inline __m512 bf16x16_load(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

static inline __m512i f32x16_to_bf16(__m512 f) { /* f32_to_bf16 of each, in the low 16 bits */
    __m512i b = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

static inline __m512 bf16x16_value(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }

static inline void bf16x16_store(uint16_t *x, __m512i h) {
    _mm256_storeu_si256((__m256i *)x, _mm512_cvtepi32_epi16(h));
}

static inline __m512i hash32x16(uint32_t key, __m512i idx) { /* hash32 of each */
    __m512i h = _mm512_add_epi32(_mm512_mullo_epi32(idx, _mm512_set1_epi32((int)0x9E3779B1u)), _mm512_set1_epi32((int)key));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85EBCA6Bu));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xC2B2AE35u));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

/* write_bf16 of 16 weights p32 + delta under mode 0 (kahan: *c holds the buffer's bits, in the low 16, and gets the
 * new ones) or 1 (stochastic, with `noise`): the new weights' bits, in each lane's low 16. Round to nearest is
 * f32x16_to_bf16 of the new value itself. */
static inline __m512i write_bf16x16(__m512 p32, __m512 delta, __m512i *c, __m512i noise, int mode) {
    if (mode == 0) {
        __m512 y = _mm512_add_ps(delta, bf16x16_value(*c));
        __m512i h = f32x16_to_bf16(_mm512_add_ps(p32, y));
        *c = f32x16_to_bf16(_mm512_sub_ps(y, _mm512_sub_ps(bf16x16_value(h), p32)));
        return h;
    }
    __m512i b = _mm512_castps_si512(_mm512_add_ps(p32, delta));
    return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_srli_epi32(noise, 16)), 16);
}
#endif

/* The loops of a step over elements [start, end) of one bf16 weight tensor p with fp32 state: per element, BODY
 * computes the new weight `fresh` (fp32) from `p32` (the weight) and `g32` (the gradient: bf16 where g_bf16, else
 * fp32), updating the state of element i, and the weight is written under compensation `mode` (write_bf16; c: the
 * Kahan buffer under mode 0; key: the weight noise key under 1; mode 2 rounds `fresh` itself, as torch's copy_).
 * One loop per gradient dtype and mode, each a constant in its loop: a branch inside would stop the vectorizer. */
#define BF16_WEIGHT_LOOP_(p, G32, c, key, MODE, start, end, BODY)                                           \
    for (int64_t i = (start); i < (end); i++) {                                                           \
        float p32 = bf16_to_f32((p)[i]), g32 = (G32), fresh;                                              \
        BODY;                                                                                             \
        (p)[i] = MODE == 2 ? f32_to_bf16(fresh)                                                           \
                           : write_bf16(p32, fresh - p32, MODE == 0 ? &(c)[i] : NULL,                      \
                                        hash32((uint32_t)(key), (uint32_t)i), MODE);                       \
    }
#define BF16_WEIGHT_MODES_(p, G32, c, key, mode, start, end, BODY)                                          \
    if ((mode) == 0) {                                                                                    \
        BF16_WEIGHT_LOOP_(p, G32, c, key, 0, start, end, BODY)                                            \
    } else if ((mode) == 1) {                                                                             \
        BF16_WEIGHT_LOOP_(p, G32, c, key, 1, start, end, BODY)                                            \
    } else {                                                                                              \
        BF16_WEIGHT_LOOP_(p, G32, c, key, 2, start, end, BODY)                                            \
    }
#define BF16_WEIGHT_LOOPS(p, g, g_bf16, c, key, mode, start, end, BODY)                                     \
    if (g_bf16) {                                                                                         \
        const uint16_t *restrict gb_ = (const uint16_t *)(g);                                             \
        BF16_WEIGHT_MODES_(p, bf16_to_f32(gb_[i]), c, key, mode, start, end, BODY)                        \
    } else {                                                                                              \
        const float *restrict gf_ = (const float *)(g);                                                   \
        BF16_WEIGHT_MODES_(p, gf_[i], c, key, mode, start, end, BODY)                                     \
    }

/* Largest finite values: a second moment at most this large stays finite in its storage (fp32 max rounds to bf16
 * inf). */
#define F32_MAX 3.40282346638528859811704183484516925e+38f
#define BF16_MAX 3.38953138925153547590470800371487867e+38f /* 0x7F7F */

/* x limited to at most limit, as torch.clamp(max=limit): a NaN stays NaN (comparisons with it are false). */
static inline float clamp_max(float x, float limit) { return x > limit ? limit : x; }

/* BODY for each tensor t among `count` whose items [piece_start, piece_end), numbered within t, fall in
 * [start, end) of the tensors' concatenation; `items` is an expression of t: how many items tensor t has. */
#define FOR_EACH_PIECE(count, items, start, end, BODY)                                                    \
    for (int64_t t = 0, offset_ = 0; t < (count) && offset_ < (end); offset_ += (items), t++) {           \
        int64_t piece_start = (start) > offset_ ? (start) - offset_ : 0;                                  \
        int64_t piece_end = (end) - offset_ < (items) ? (end) - offset_ : (items);                        \
        if (piece_start < piece_end) BODY;                                                                \
    }

/* Run BODY on disjoint pieces of [start, end) that cover it, one per thread of an OpenMP team of up to `threads`,
 * each a multiple of 64 items (cache lines of every dtype) but the last, as `range_start` / `range_end`. The
 * pieces follow the team OpenMP actually gives (OMP_THREAD_LIMIT, OMP_DYNAMIC, nested regions may give fewer
 * threads than asked): splitting by the number asked for would leave the pieces of missing threads undone.
 * Without OpenMP, the whole range runs here. */
#ifdef _OPENMP
#include <omp.h>
#define PARALLEL_RANGES(start, end, threads, BODY)                                                        \
    do {                                                                                                  \
        _Pragma("omp parallel num_threads(threads)") {                                                    \
            int64_t team_ = omp_get_num_threads();                                                        \
            int64_t per_ = (((end) - (start) + team_ - 1) / team_ + 63) / 64 * 64; /* ceil, then to 64 */ \
            int64_t range_start = (start) + per_ * omp_get_thread_num();                                 \
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
