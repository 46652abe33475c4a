/* Shared by this package's C kernels: the compensation modes, bf16 conversions as torch's, the compensated write of a
 * bf16 weight, the tensors a range of their concatenation covers, the split of a range over threads, and the clamps
 * that keep moments finite.
 *
 * The kernels' interface: a compensation mode is a comp_mode_t; a kernel's per-tensor scalars are a struct of named
 * floats (the Python builder writes them in the struct's order, one float each); weight decay is the multiplicative
 * `decay` = 1 - lr * wd (torch's decoupled p *= 1 - lr * wd) unless a kernel's reference needs another form (its
 * struct then names it otherwise and says why). Kernels are specialized by always-inline functions called with
 * constant arguments, never by macros that take code. */
#ifndef HF_EFF_NATIVE_H
#define HF_EFF_NATIVE_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* How an update reaches a bf16 weight: compensation.C_MODES's numbers (and optim/_triton.py's). */
typedef enum { KAHAN = 0, STOCHASTIC = 1, NONE = 2 } comp_mode_t;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Round to nearest even, as torch, but with no NaN test: every NaN here is a quieted bf16 NaN (low 16 bits
 * zero) or the CPU's default NaN, which this rounding keeps NaN (torch's test only picks the payload, and its
 * own vectorized and scalar conversions disagree on that): the test is a visible share of the bf16 kernel's time. */
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

/* compensation.write for a bf16 weight: p32 + delta under KAHAN (*c carries what the rounded weight did not absorb),
 * STOCHASTIC (with `noise`) or NONE (nearest). Inlined with a constant mode, the other branches vanish. */
static inline uint16_t write_bf16(float p32, float delta, uint16_t *c, uint32_t noise, comp_mode_t mode) {
    if (mode == KAHAN) {
        float y = delta + bf16_to_f32(*c);
        uint16_t fresh = f32_to_bf16(p32 + y);
        *c = f32_to_bf16(y - (bf16_to_f32(fresh) - p32));
        return fresh;
    }
    if (mode == STOCHASTIC)
        return round_stochastic(p32 + delta, noise);
    return f32_to_bf16(p32 + delta);
}

/* The new value `fresh` of element i of a bf16 weight (p32 before the step) as compensation.write_all writes it:
 * write_bf16 of the step's delta (c: the Kahan buffer under KAHAN; key: the weight noise key under STOCHASTIC), or
 * under NONE `fresh` itself rounded, as torch's copy_ (not p32 + (fresh - p32)). */
ALWAYS_INLINE uint16_t write_weight(float p32, float fresh, uint16_t *c, uint32_t key, int64_t i, comp_mode_t mode) {
    if (mode == NONE)
        return f32_to_bf16(fresh);
    return write_bf16(p32, fresh - p32, mode == KAHAN ? &c[i] : NULL, hash32(key, (uint32_t)i), mode);
}

/* Element i of x (fp32, or bf16 where is_bf16) as fp32. */
ALWAYS_INLINE float load_f32(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
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

/* write_bf16 of 16 weights p32 + delta under KAHAN (*c holds the buffer's bits, in the low 16, and gets the new ones)
 * or STOCHASTIC (with `noise`): the new weights' bits, in each lane's low 16. Round to nearest (NONE) is
 * f32x16_to_bf16 of the new value itself. */
static inline __m512i write_bf16x16(__m512 p32, __m512 delta, __m512i *c, __m512i noise, comp_mode_t mode) {
    if (mode == KAHAN) {
        __m512 y = _mm512_add_ps(delta, bf16x16_value(*c));
        __m512i h = f32x16_to_bf16(_mm512_add_ps(p32, y));
        *c = f32x16_to_bf16(_mm512_sub_ps(y, _mm512_sub_ps(bf16x16_value(h), p32)));
        return h;
    }
    __m512i b = _mm512_castps_si512(_mm512_add_ps(p32, delta));
    return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_srli_epi32(noise, 16)), 16);
}
#endif

/* Largest finite values: a second moment at most this large stays finite in its storage (fp32 max rounds to bf16
 * inf). */
#define F32_MAX 3.40282346638528859811704183484516925e+38f
#define BF16_MAX 3.38953138925153547590470800371487867e+38f /* 0x7F7F */

/* x limited to at most limit, as torch.clamp(max=limit): a NaN stays NaN (comparisons with it are false). */
static inline float clamp_max(float x, float limit) { return x > limit ? limit : x; }

/* The part of [start, end) of a concatenation that falls in its tensor of `items` items at `offset`, as items
 * [*lo, *hi) numbered within that tensor; returns whether it is not empty. A kernel walks its tensors with it:
 *     for (int64_t t = 0, offset = 0; t < count && offset < end; offset += items(t), t++)
 *         if (piece(start, end, offset, items(t), &lo, &hi)) step_one(t, lo, hi); */
ALWAYS_INLINE int piece(int64_t start, int64_t end, int64_t offset, int64_t items, int64_t *lo, int64_t *hi) {
    *lo = start > offset ? start - offset : 0;
    *hi = end - offset < items ? end - offset : items;
    return *lo < *hi;
}

/* This thread's piece [*lo, *hi) of [start, end), called inside `#pragma omp parallel num_threads(threads)`: the
 * team's pieces are disjoint and cover the range, each a multiple of 64 items (cache lines of every dtype) but the
 * last. They follow the team OpenMP actually gives (OMP_THREAD_LIMIT, OMP_DYNAMIC, nested regions may give fewer
 * threads than asked): splitting by the number asked for would leave the pieces of missing threads undone. Without
 * OpenMP (the pragma ignored), the whole range is this thread's. Returns whether the piece is not empty. */
ALWAYS_INLINE int thread_range(int64_t start, int64_t end, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
    int64_t team = 1, me = 0;
#endif
    int64_t per = ((end - start + team - 1) / team + 63) / 64 * 64; /* ceil, then to 64 */
    *lo = start + per * me;
    *hi = *lo + per < end ? *lo + per : end;
    return *lo < *hi;
}
#endif
