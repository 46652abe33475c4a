/* Shared by this package's C kernels: the compensation modes, bf16 conversions as torch's, the compensated write of a
 * bf16 weight, the clamps that keep moments finite, and what drives a kernel, written once: the split of a range over
 * threads (run_team), the walk over a concatenation of tensors (walk), and the dispatch on weight dtype, gradient dtype
 * and compensation mode (with_kind). elementwise.h and blockwise.h build a family's kernel from them and its family_t.
 *
 * The kernels' interface: a compensation mode is a comp_mode_t; a kernel's per-tensor scalars are a struct of named
 * floats (the Python builder writes them in the struct's order, one float each); weight decay is the multiplicative
 * `decay` = 1 - lr * wd (torch's decoupled p *= 1 - lr * wd) unless a kernel's reference needs another form (its
 * struct then names it otherwise and says why). Kernels are specialized by always-inline functions called with
 * constant arguments, never by macros that take code: a constant function pointer passed to an always-inline
 * function is a direct call once inlined, and GCC inlines it (with -O3 it does; the benchmarks check the speed). */
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

/* The new value `fresh` of a bf16 weight (p32 before the step) as compensation.write_all writes it: write_bf16 of the
 * step's delta (c: the element's Kahan buffer entry under KAHAN; noise: its hash32 under STOCHASTIC), or under NONE
 * `fresh` itself rounded, as torch's copy_ (not p32 + (fresh - p32)). */
ALWAYS_INLINE uint16_t write_weight(float p32, float fresh, uint16_t *c, uint32_t noise, comp_mode_t mode) {
    if (mode == NONE)
        return f32_to_bf16(fresh);
    return write_bf16(p32, fresh - p32, c, noise, mode);
}

/* Element i of x (fp32, or bf16 where is_bf16) as fp32. */
ALWAYS_INLINE float load_f32(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* Largest finite values: a second moment at most this large stays finite in its storage (fp32 max rounds to bf16
 * inf). */
#define F32_MAX 3.40282346638528859811704183484516925e+38f
#define BF16_MAX 3.38953138925153547590470800371487867e+38f /* 0x7F7F */

/* x limited to at most limit, as torch.clamp(max=limit): a NaN stays NaN (comparisons with it are false). */
static inline float clamp_max(float x, float limit) { return x > limit ? limit : x; }

/* The part of [start, end) of a concatenation that falls in its tensor of `items` items at `offset`, as items
 * [*lo, *hi) numbered within that tensor; returns whether it is not empty (walk's step). */
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
/* --------------------------------------------------------------------------------------------- what drives a kernel */

#define MAX_STATES 2  /* state values per element a family keeps (AdamW's two moments) */
#define MAX_COEFS 16  /* floats of a family's coefficient struct, at most */

/* A family's update of one element: its new weight from the weight p and the gradient g (fp32), its state values s[]
 * (fp32, updated in place) and its per-tensor scalars k (its coefficient struct); i: the element's index in its
 * tensor of n elements (torch's fused AdamW rounds its vectorized body and its scalar tail apart). */
typedef float (*update_fn)(float p, float g, float *s, const void *k, int64_t i, int64_t n);

/* A family's math as the drivers (elementwise.h, blockwise.h) take it: a static const object, so that a driver inlined
 * with its address folds every field to a constant (the update inlined, the loops over states unrolled). */
typedef struct {
    update_fn update;
    int states;                /* state values per element: s[0 .. states) */
    int coefs;                 /* floats of its coefficient struct (at most MAX_COEFS) */
    int is_signed[MAX_STATES]; /* 8-bit state: each moment's map (quant8's signed or unsigned) */
} family_t;

/* The split over threads, written once: range(args, lo, hi) on each thread's piece of [start, end) (thread_range)
 * on `threads` OpenMP threads, or once without OpenMP. A kernel's `range` comes as a pointer, called once a thread:
 * GCC outlines a parallel region before it inlines, so a region inside an inlined driver could not see it constant. */
typedef void (*range_fn)(const void *args, int64_t start, int64_t end);
static inline void run_team(range_fn range, const void *args, int64_t start, int64_t end, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        if (thread_range(start, end, &lo, &hi))
            range(args, lo, hi);
    }
    (void)threads;
}

/* The walk over a concatenation, written once: part(args, f, t, lo, hi) on each tensor's part [lo, hi) of the units
 * [start, end) of the concatenation of `count` tensors (numel[t] elements each, counted in units of `unit` elements:
 * 1, or blocks, a tensor's last one partial), in order, until a part returns non-zero; returns that part's tensor, or
 * -1. f: the family the parts step (NULL for a kernel of its own). */
typedef int (*part_fn)(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi);
ALWAYS_INLINE int64_t walk(part_fn part, const void *args, const family_t *f, int64_t count, const int64_t *numel,
                           int64_t unit, int64_t start, int64_t end) {
    int64_t lo, hi;
    for (int64_t t = 0, offset = 0; t < count && offset < end; offset += (numel[t] + unit - 1) / unit, t++)
        if (piece(start, end, offset, (numel[t] + unit - 1) / unit, &lo, &hi) && part(args, f, t, lo, hi))
            return t;
    return -1;
}

/* The dispatch on a part's kind, written once: body(args, f, t, lo, hi, p_bf16, g_bf16, mode) with the weights' dtype,
 * the gradients' (bf16, or fp32) and the compensation mode as constants, so that each kind is a loop of its own that
 * the compiler vectorizes (a branch on any of them inside the loop would stop it). fp32 weights are written as
 * computed: mode NONE. Kinds a kernel never meets (weights always bf16, gradients of the weights' dtype) fold away
 * where its arguments are constants or one value. */
typedef void (*kind_fn)(const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi, int p_bf16,
                        int g_bf16, comp_mode_t mode);
ALWAYS_INLINE void with_kind(kind_fn body, const void *args, const family_t *f, int64_t t, int64_t lo, int64_t hi,
                             int p_bf16, int g_bf16, comp_mode_t mode) {
    if (!p_bf16)
        g_bf16 ? body(args, f, t, lo, hi, 0, 1, NONE) : body(args, f, t, lo, hi, 0, 0, NONE);
    else if (mode == KAHAN)
        g_bf16 ? body(args, f, t, lo, hi, 1, 1, KAHAN) : body(args, f, t, lo, hi, 1, 0, KAHAN);
    else if (mode == STOCHASTIC)
        g_bf16 ? body(args, f, t, lo, hi, 1, 1, STOCHASTIC) : body(args, f, t, lo, hi, 1, 0, STOCHASTIC);
    else
        g_bf16 ? body(args, f, t, lo, hi, 1, 1, NONE) : body(args, f, t, lo, hi, 1, 0, NONE);
}
#endif
