/* Adafactor's step on CPU for contiguous fp32 and bf16 weights and gradients: adafactor.py's eager operations, in
 * their order, over all the tensors of a step in one call on torch's OpenMP threads (built with -ffp-contract=off:
 * every fp32 operation rounds as torch's do; torch's lerp is a fused multiply-add, so fmaf here too).
 *
 * Why passes. A matrix's update u = g * r_i * c_j needs the row and column statistics of the whole gradient, and the
 * RMS clip needs the sum of u * u before any weight is written. r_i^2 = mean / row_i, c_j^2 = 1 / col_j, so that sum
 * is k * mean * sum_j D_j / col_j with D_j = sum_i (g_ij / k) * (g_ij / row_i): P1 reads g once for the row sums, the column sums and
 * D (row_i is known once its row is summed; the row is read again from L1), P2 finishes the statistics, the row
 * factors and the sum, P3 reads g again and writes the weights. A vector: P1 (its statistics and its update's
 * squares, in double) and P3. Tensors are stepped in groups of about `group_bytes` of gradient, the passes of a few
 * groups at a time (the pipeline in adafactor_step), so that P3's read of g hits the cache: memory sees one read of
 * g and one read and write of the weights (and of exp_avg, kahan_comp).
 *
 * Results do not depend on the number of threads: work is cut in units fixed by the shapes, each unit writes its own
 * partial sums, and partial sums are added in unit order. Sums differ from torch's in order only: the row and column
 * sums (fp32, as torch) and the sum of squares (double here and in the eager path).
 *
 * meta (per tensor, NMETA int64): dtype (0 fp32, 1 bf16), batch, rows, cols (0: a vector of `rows` elements), mode
 * (compensation.C_MODES: 0 kahan, 1 stochastic, 2 nearest; fp32 weights ignore it), stochastic rounding key,
 * whether it keeps a first moment (exp_avg[t]).
 * coef (per tensor, NCOEF double, rounded to fp32 here where torch's ops round a Python number): 1/k, k/cols, k/rows
 * (k = max(rows, cols)), eps, 1 - beta2_t, 1 - lr * weight_decay, lr, 1 - beta1, clip_threshold.
 * comp[t]: the Kahan buffer of a bf16 weight under kahan (else unused). Returns 0, or -1 (no memory for
 * the scratch: nothing was changed).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

enum { DTYPE, BATCH, ROWS, COLS, MODE, KEY, FIRST, NMETA };
enum { INV_K, K_COLS, K_ROWS, EPS, W, DECAY, LR, OMB1, CLIP, NCOEF };

#ifndef UNIT
#define UNIT (1 << 16) /* elements per unit of work: a few units per thread keeps the split even */
#endif
#ifndef MAX_SLOTS
#define MAX_SLOTS 64 /* row slices of a matrix, each with its partial column sums (2 x 64 x cols floats) */
#endif
#ifndef COL_CHUNK
#define COL_CHUNK 2048 /* columns per unit of P2 */
#endif
#define RING 3   /* groups in flight at once (the pipeline in adafactor_step) */
#define LANES 32 /* independent accumulators of a sum (vectorized without reassociating the additions) */
#define SQRT_F32_MAX 18446742974197923840.0f /* 2**64 (1 - 2**-24): the largest float whose square is finite */

typedef struct {
    int64_t batch, n, m;      /* a batch of n x m matrices, or (m == 0) a vector of n elements */
    int64_t per_unit, slots;  /* rows (elements for a vector) per unit; units per matrix */
    int64_t units, col_units; /* units of P1 and P3, and of P2 */
    int64_t unit0, col_unit0; /* first unit of each kind within the group */
    int64_t group;
    /* offsets in the group's scratch: floats (column and D partial sums, row and column factors) and doubles (sums of
     * squares: per P2 column unit of a matrix, per P1 unit of a vector; a matrix's row means) */
    int64_t colpart, dpart, rinv, cinv, part, mean;
} plan_t;

/* torch.lerp: a fused multiply-add from the nearer end */
static inline float lerpf(float start, float end, float w) {
    return fabsf(w) < 0.5f ? fmaf(w, end - start, start) : fmaf(w - 1.0f, end - start, end);
}

static inline __attribute__((always_inline)) float load(const void *x, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* torch.clamp(x, -SQRT_F32_MAX, SQRT_F32_MAX): a NaN stays NaN */
static inline float clamp_sq(float x) { return x < -SQRT_F32_MAX ? -SQRT_F32_MAX : (x > SQRT_F32_MAX ? SQRT_F32_MAX : x); }

/* The lanes added pairwise, halves at a time (constant trip counts: vector adds, not a scalar loop per row). */
#define HALVE(acc, h)                                                                                              \
    for (int l = 0; l < (h); l++)                                                                                  \
        acc[l] += acc[l + (h)];

static inline float fsum_lanes(float *acc) {
    HALVE(acc, 16) HALVE(acc, 8) HALVE(acc, 4) HALVE(acc, 2) HALVE(acc, 1)
    return acc[0];
}

static inline double dsum_lanes(double *acc) {
    HALVE(acc, 16) HALVE(acc, 8) HALVE(acc, 4) HALVE(acc, 2) HALVE(acc, 1)
    return acc[0];
}

/* ---------------------------------------------------------------------------------------------- matrices */

/* P1 on rows [i0, i1) of one matrix: each row's sum of s = (g / k) * g made its statistic row_i, and into the
 * column partial sums cp (s) and dp ((g / k) * (g / row_i): no square formed, so no overflow before the division). */
static inline __attribute__((always_inline)) void p1_matrix(const void *g, float *restrict row, float *restrict cp,
                                                             float *restrict dp, int64_t m, int64_t i0, int64_t i1,
                                                             const double *coef, const int bf16) {
    const float inv_k = (float)coef[INV_K], k_m = (float)coef[K_COLS], eps = (float)coef[EPS], w = (float)coef[W];
    for (int64_t j = 0; j < m; j++)
        cp[j] = dp[j] = 0.0f;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t base = i * m;
        float acc[LANES] = {0};
        int64_t j = 0;
        for (; j + LANES <= m; j += LANES)
            for (int l = 0; l < LANES; l++) {
                float x = load(g, base + j + l, bf16);
                float s = (x * inv_k) * x;
                acc[l] += s;
                cp[j + l] += s;
            }
        for (int l = 0; j + l < m; l++) {
            float x = load(g, base + j + l, bf16);
            float s = (x * inv_k) * x;
            acc[l] += s;
            cp[j + l] += s;
        }
        const float r = lerpf(row[i], clamp_max(fsum_lanes(acc) * k_m + eps, F32_MAX), w);
        row[i] = r;
        const float rr = 1.0f / r;
        for (j = 0; j < m; j++) { /* the row again, from L1 */
            float x = load(g, base + j, bf16);
            dp[j] += (x * inv_k) * (x * rr);
        }
    }
}

/* P2, columns [j0, j1) of one matrix: the slots' partial sums added in order, made the column statistic and its
 * factor; returns sum_j D_j / col_j (double) for the clip. */
static double p2_cols(const float *cp, const float *dp, int64_t slots, int64_t m, int64_t j0, int64_t j1,
                      float *restrict col, float *restrict cinv, const double *coef) {
    const float k_n = (float)coef[K_ROWS], eps = (float)coef[EPS], w = (float)coef[W];
    float tot[COL_CHUNK], dtot[COL_CHUNK];
    const int64_t len = j1 - j0;
    memcpy(tot, cp + j0, len * sizeof(float));
    memcpy(dtot, dp + j0, len * sizeof(float));
    for (int64_t s = 1; s < slots; s++)
        for (int64_t j = 0; j < len; j++) {
            tot[j] += cp[s * m + j0 + j];
            dtot[j] += dp[s * m + j0 + j];
        }
    double acc[LANES] = {0};
    for (int64_t j = 0; j < len; j++) {
        float c = lerpf(col[j0 + j], clamp_max(tot[j] * k_n + eps, F32_MAX), w);
        col[j0 + j] = c;
        cinv[j0 + j] = 1.0f / sqrtf(c);
        acc[j % LANES] += (double)dtot[j] / (double)c;
    }
    return dsum_lanes(acc);
}

/* P2, the row factors of one matrix: rsqrt(row / mean(row)), the mean summed in double (as the eager path); returns
 * the mean. */
static float p2_rows(const float *row, int64_t n, float *restrict rinv) {
    const float nf = (float)n;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += (double)(row[i] / nf);
    const float mean = clamp_max((float)s, F32_MAX);
    for (int64_t i = 0; i < n; i++)
        rinv[i] = 1.0f / sqrtf(row[i] / mean);
    return mean;
}

/* ---------------------------------------------------------------------------------------------- the write */

typedef struct {
    float decay, step, scale, omb1;
    uint32_t key;
} write_t;

/* One weight: the clipped update (through the first moment if any) applied, then written under the mode. */
static inline __attribute__((always_inline)) void write_one(void *p, float *restrict m1, uint16_t *restrict comp,
                                                             int64_t e, int64_t idx, float u, const write_t c,
                                                             const int bf16, const comp_mode_t mode, const int beta1) {
    if (beta1) {
        u = lerpf(m1[e], u * c.scale, c.omb1);
        m1[e] = u;
    }
    if (!bf16) {
        float *pf = p;
        pf[e] = pf[e] * c.decay + u * c.step;
        return;
    }
    uint16_t *pb = p;
    const float p32 = bf16_to_f32(pb[e]);
    const float fresh = p32 * c.decay + u * c.step;
    pb[e] = write_bf16(p32, fresh - p32, mode == KAHAN ? &comp[e] : NULL,
                       mode == STOCHASTIC ? hash32(c.key, (uint32_t)idx) : 0, mode);
}

/* P3 on rows [i0, i1) of a matrix (p, g, m1, comp at its first element; idx0: the index of that element). */
static inline __attribute__((always_inline)) void p3_matrix(void *p, const void *g, float *m1, uint16_t *comp,
                                                             const float *rinv, const float *cinv, int64_t m,
                                                             int64_t i0, int64_t i1, int64_t idx0, const write_t c,
                                                             const int bf16, const comp_mode_t mode, const int beta1) {
    for (int64_t i = i0; i < i1; i++) {
        const float r = rinv[i];
        for (int64_t j = 0; j < m; j++) {
            const int64_t e = i * m + j;
            write_one(p, m1, comp, e, idx0 + e, (load(g, e, bf16) * r) * cinv[j], c, bf16, mode, beta1);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- vectors */

/* P1 on elements [a, b): v = lerp(v, g*g + eps, w) with g clamped to SQRT_F32_MAX; the update's squares summed (in
 * double: exact squares, no overflow). */
static inline __attribute__((always_inline)) double p1_vector(const void *g, float *restrict v, int64_t a, int64_t b,
                                                               const double *coef, const int bf16) {
    const float eps = (float)coef[EPS], w = (float)coef[W];
    double acc[LANES] = {0};
    int64_t e = a;
    for (; e + LANES <= b; e += LANES)
        for (int l = 0; l < LANES; l++) {
            float x = clamp_sq(load(g, e + l, bf16));
            float vn = lerpf(v[e + l], x * x + eps, w);
            v[e + l] = vn;
            double u = (double)(x * (1.0f / sqrtf(vn)));
            acc[l] = fma(u, u, acc[l]);
        }
    for (int l = 0; e + l < b; l++) {
        float x = clamp_sq(load(g, e + l, bf16));
        float vn = lerpf(v[e + l], x * x + eps, w);
        v[e + l] = vn;
        double u = (double)(x * (1.0f / sqrtf(vn)));
        acc[l] = fma(u, u, acc[l]);
    }
    return dsum_lanes(acc);
}

static inline __attribute__((always_inline)) void p3_vector(void *p, const void *g, float *m1, uint16_t *comp,
                                                             const float *v, int64_t a, int64_t b, const write_t c,
                                                             const int bf16, const comp_mode_t mode, const int beta1) {
    for (int64_t e = a; e < b; e++)
        write_one(p, m1, comp, e, e, clamp_sq(load(g, e, bf16)) * (1.0f / sqrtf(v[e])), c, bf16, mode, beta1);
}

/* ---------------------------------------------------------------------------------------------- dispatch */

typedef struct {
    void *const *p;
    const void *const *g;
    float *const *stat; /* row statistics (a matrix) or exp_avg_sq (a vector) */
    float *const *col;
    float *const *exp_avg;
    uint16_t *const *comp;
    const int64_t *meta;
    const double *coef;
    const plan_t *plan;
    float *fs;  /* RING group scratches of fs_size floats */
    double *ds; /* and of ds_size doubles */
    int64_t fs_size, ds_size;
} step_t;

/* Tensor t's scratch: groups in flight together use different ones. */
static inline float *fscratch(const step_t *s, int64_t t) { return s->fs + (s->plan[t].group % RING) * s->fs_size; }

static inline double *dscratch(const step_t *s, int64_t t) { return s->ds + (s->plan[t].group % RING) * s->ds_size; }

/* The bounds [*i0, *i1) of unit u's rows (elements of a vector) in its matrix *b. */
static inline void unit_rows(const plan_t *pl, int64_t u, int64_t *b, int64_t *i0, int64_t *i1) {
    *b = pl->m ? u / pl->slots : 0;
    *i0 = (pl->m ? u % pl->slots : u) * pl->per_unit;
    *i1 = *i0 + pl->per_unit < pl->n ? *i0 + pl->per_unit : pl->n;
}

static void run_p1(const step_t *s, int64_t t, int64_t u) {
    const plan_t *pl = &s->plan[t];
    const int bf16 = s->meta[t * NMETA + DTYPE] == 1;
    const double *coef = s->coef + t * NCOEF;
    int64_t b, i0, i1;
    unit_rows(pl, u, &b, &i0, &i1);
    if (pl->m == 0) {
        dscratch(s, t)[pl->part + u] = bf16 ? p1_vector(s->g[t], s->stat[t], i0, i1, coef, 1)
                                            : p1_vector(s->g[t], s->stat[t], i0, i1, coef, 0);
        return;
    }
    const int64_t off = b * pl->n * pl->m;
    float *fs = fscratch(s, t), *cp = fs + pl->colpart + u * pl->m, *dp = fs + pl->dpart + u * pl->m;
    if (bf16)
        p1_matrix((const uint16_t *)s->g[t] + off, s->stat[t] + b * pl->n, cp, dp, pl->m, i0, i1, coef, 1);
    else
        p1_matrix((const float *)s->g[t] + off, s->stat[t] + b * pl->n, cp, dp, pl->m, i0, i1, coef, 0);
}

static void run_p2(const step_t *s, int64_t t, int64_t u) {
    const plan_t *pl = &s->plan[t];
    const int64_t chunks = (pl->m + COL_CHUNK - 1) / COL_CHUNK;
    const int64_t b = u / (chunks + 1), c = u % (chunks + 1);
    float *fs = fscratch(s, t);
    double *ds = dscratch(s, t);
    if (c == chunks) {
        ds[pl->mean + b] = p2_rows(s->stat[t] + b * pl->n, pl->n, fs + pl->rinv + b * pl->n);
        return;
    }
    const int64_t j0 = c * COL_CHUNK, j1 = j0 + COL_CHUNK < pl->m ? j0 + COL_CHUNK : pl->m;
    const int64_t first = b * pl->slots * pl->m;
    ds[pl->part + b * chunks + c] = p2_cols(fs + pl->colpart + first, fs + pl->dpart + first, pl->slots, pl->m, j0, j1,
                                            s->col[t] + b * pl->m, fs + pl->cinv + b * pl->m, s->coef + t * NCOEF);
}

/* The clip of tensor t, scale = 1 / max(rms / clip, 1), from its partial sums added in order; every unit of P3
 * computes it (a few dozen additions), which saves a pass and a wait. */
static write_t finish_scale(const step_t *s, int64_t t) {
    const plan_t *pl = &s->plan[t];
    const double *coef = s->coef + t * NCOEF, *ds = dscratch(s, t);
    double sumsq = 0.0;
    if (pl->m == 0) {
        for (int64_t u = 0; u < pl->units; u++)
            sumsq += ds[pl->part + u];
    } else {
        const int64_t chunks = (pl->m + COL_CHUNK - 1) / COL_CHUNK;
        for (int64_t b = 0; b < pl->batch; b++) {
            double over_cols = 0.0;
            for (int64_t c = 0; c < chunks; c++)
                over_cols += ds[pl->part + b * chunks + c];
            sumsq += ds[pl->mean + b] * over_cols;
        }
        sumsq *= (double)(pl->n > pl->m ? pl->n : pl->m); /* D summed (g / k) * (g / row) */
    }
    const int64_t numel = pl->m ? pl->batch * pl->n * pl->m : pl->n;
    const double ratio = sqrt(sumsq / (double)(numel > 1 ? numel : 1)) / coef[CLIP];
    const double scale = 1.0 / (1.0 > ratio ? 1.0 : ratio); /* Python's max(ratio, 1.0): a NaN ratio stays NaN */
    write_t w;
    w.decay = (float)coef[DECAY];
    w.omb1 = (float)coef[OMB1];
    w.scale = (float)scale;
    w.step = s->meta[t * NMETA + FIRST] ? (float)(-coef[LR]) : (float)(-coef[LR] * scale);
    w.key = (uint32_t)s->meta[t * NMETA + KEY];
    return w;
}

/* A unit of P3: rows [i0, i1) of a matrix (rinv, cinv: its factors) or elements [i0, i1) of a vector (m == 0; rinv:
 * its exp_avg_sq), p, g, m1, comp at its first element (idx0: that element's index), for with_kind. */
typedef struct {
    void *p;
    const void *g;
    float *m1;
    uint16_t *comp;
    const float *rinv, *cinv;
    int64_t m, idx0;
    write_t c;
    int beta1;
} p3_t;

ALWAYS_INLINE void p3_kind(const void *args, const family_t *f, int64_t t, int64_t i0, int64_t i1, const int bf16,
                           int g_bf16, const comp_mode_t mode) {
    const p3_t *a = args;
    (void)f, (void)t, (void)g_bf16; /* gradients of the weights' dtype */
    if (a->m == 0 && a->beta1)
        p3_vector(a->p, a->g, a->m1, a->comp, a->rinv, i0, i1, a->c, bf16, mode, 1);
    else if (a->m == 0)
        p3_vector(a->p, a->g, a->m1, a->comp, a->rinv, i0, i1, a->c, bf16, mode, 0);
    else if (a->beta1)
        p3_matrix(a->p, a->g, a->m1, a->comp, a->rinv, a->cinv, a->m, i0, i1, a->idx0, a->c, bf16, mode, 1);
    else
        p3_matrix(a->p, a->g, a->m1, a->comp, a->rinv, a->cinv, a->m, i0, i1, a->idx0, a->c, bf16, mode, 0);
}

static void run_p3(const step_t *s, int64_t t, int64_t u) {
    const plan_t *pl = &s->plan[t];
    const int64_t *meta = s->meta + t * NMETA;
    const int bf16 = meta[DTYPE] == 1, beta1 = meta[FIRST] != 0;
    int64_t b, i0, i1;
    unit_rows(pl, u, &b, &i0, &i1);
    if (pl->m == 0) {
        const p3_t unit = {s->p[t], s->g[t], s->exp_avg[t], s->comp[t], s->stat[t], NULL, 0, 0, finish_scale(s, t),
                           beta1};
        with_kind(p3_kind, &unit, NULL, t, i0, i1, bf16, bf16, (comp_mode_t)meta[MODE]);
        return;
    }
    const int64_t off = b * pl->n * pl->m;
    const size_t esize = bf16 ? 2 : 4;
    const float *fs = fscratch(s, t);
    const p3_t unit = {(char *)s->p[t] + off * esize, (const char *)s->g[t] + off * esize,
                       beta1 ? s->exp_avg[t] + off : NULL, s->comp[t] ? s->comp[t] + off : NULL,
                       fs + pl->rinv + b * pl->n, fs + pl->cinv + b * pl->m, pl->m, off, finish_scale(s, t), beta1};
    with_kind(p3_kind, &unit, NULL, t, i0, i1, bf16, bf16, (comp_mode_t)meta[MODE]);
}

/* The tensor among [t0, t1) whose units (P2's if `cols`) hold unit u. */
static int64_t owner(const plan_t *plan, int64_t t0, int64_t t1, int64_t u, int cols) {
    while (t1 - t0 > 1) {
        int64_t mid = (t0 + t1) / 2;
        if ((cols ? plan[mid].col_unit0 : plan[mid].unit0) <= u)
            t0 = mid;
        else
            t1 = mid;
    }
    return t0;
}

/* Cut each tensor into units and the tensors into groups; returns the number of groups (bounds in `first`), and the
 * largest scratch of a group in *floats and *doubles. */
static int64_t make_plan(int64_t count, const int64_t *meta, int64_t group_bytes, plan_t *plan, int64_t *first,
                         int64_t *floats, int64_t *doubles) {
    int64_t groups = 0, bytes = 0, units = 0, col_units = 0, fs = 0, ds = 0;
    *floats = *doubles = 0;
    for (int64_t t = 0; t < count; t++) {
        const int64_t *mt = meta + t * NMETA;
        plan_t *pl = &plan[t];
        pl->batch = mt[BATCH], pl->n = mt[ROWS], pl->m = mt[COLS];
        const int64_t numel = pl->m ? pl->batch * pl->n * pl->m : pl->n;
        const int64_t tb = numel * (mt[DTYPE] == 1 ? 2 : 4);
        if (t == 0 || bytes + tb > group_bytes) { /* a new group */
            first[groups++] = t;
            bytes = units = col_units = fs = ds = 0;
        }
        bytes += tb;
        pl->group = groups - 1;
        if (pl->m == 0) {
            pl->per_unit = UNIT;
            pl->slots = pl->units = (pl->n + UNIT - 1) / UNIT;
            pl->col_units = 0;
        } else {
            int64_t slots = (pl->n * pl->m + UNIT - 1) / UNIT;
            slots = slots < 1 ? 1 : (slots > MAX_SLOTS ? MAX_SLOTS : slots);
            pl->per_unit = (pl->n + slots - 1) / slots;
            pl->slots = (pl->n + pl->per_unit - 1) / pl->per_unit;
            pl->units = pl->batch * pl->slots;
            pl->col_units = pl->batch * ((pl->m + COL_CHUNK - 1) / COL_CHUNK + 1);
        }
        pl->unit0 = units, pl->col_unit0 = col_units;
        units += pl->units, col_units += pl->col_units;
        pl->part = ds;
        if (pl->m) {
            pl->mean = pl->part + pl->batch * ((pl->m + COL_CHUNK - 1) / COL_CHUNK);
            ds = pl->mean + pl->batch;
            pl->colpart = fs;
            pl->dpart = pl->colpart + pl->units * pl->m;
            pl->rinv = pl->dpart + pl->units * pl->m;
            pl->cinv = pl->rinv + pl->batch * pl->n;
            fs = pl->cinv + pl->batch * pl->m;
        } else {
            ds += pl->units;
        }
        *floats = fs > *floats ? fs : *floats;
        *doubles = ds > *doubles ? ds : *doubles;
    }
    first[groups] = count;
    return groups;
}

/* Units of a pass of group gi (none outside [0, groups)). */
static int64_t pass_units(const plan_t *plan, const int64_t *first, int64_t groups, int64_t gi, int pass) {
    if (gi < 0 || gi >= groups)
        return 0;
    const plan_t *last = &plan[first[gi + 1] - 1];
    return pass == 2 ? last->col_unit0 + last->col_units : last->unit0 + last->units;
}

/* Unit v of pass `pass` (1 to 3) of group gi. */
static void run_unit(const step_t *s, const int64_t *first, int pass, int64_t gi, int64_t v) {
    const int64_t t = owner(s->plan, first[gi], first[gi + 1], v, pass == 2);
    const plan_t *pl = &s->plan[t];
    if (pass == 1)
        run_p1(s, t, v - pl->unit0);
    else if (pass == 2)
        run_p2(s, t, v - pl->col_unit0);
    else
        run_p3(s, t, v - pl->unit0);
}

int64_t adafactor_step(int64_t count, void *const *p, const void *const *g, float *const *stat, float *const *col,
                       float *const *exp_avg, uint16_t *const *comp, const int64_t *meta, const double *coef,
                       int64_t group_bytes, int threads) {
    if (count <= 0)
        return 0;
    int64_t floats, doubles;
    plan_t *plan = malloc(count * sizeof(plan_t));
    int64_t *first = malloc((count + 1) * sizeof(int64_t));
    if (!plan || !first) {
        free(plan), free(first);
        return -1;
    }
    const int64_t groups = make_plan(count, meta, group_bytes, plan, first, &floats, &doubles);
    float *fs = malloc(RING * (floats > 0 ? floats : 1) * sizeof(float));
    double *ds = malloc(RING * (doubles > 0 ? doubles : 1) * sizeof(double));
    if (!fs || !ds) {
        free(plan), free(first), free(fs), free(ds);
        return -1;
    }
    const step_t s = {p, g, stat, col, exp_avg, comp, meta, coef, plan, fs, ds, floats, doubles};
    /* A pipeline: stage k runs P3 of group k-2, P2 of k-1 and P1 of k, and its end is the only wait: groups + 2 waits
     * for the step, where a wait after every pass of every group made 3 per group (a thread that the OS takes away
     * for a while holds the others at each). */
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t k = 0; k < groups + 2; k++) {
        const int64_t n[3] = {pass_units(plan, first, groups, k - 2, 3), pass_units(plan, first, groups, k - 1, 2),
                              pass_units(plan, first, groups, k, 1)};
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < n[0] + n[1] + n[2]; u++) {
            int64_t v = u;
            int i = 0;
            while (v >= n[i])
                v -= n[i++];
            run_unit(&s, first, 3 - i, k - 2 + i, v);
        }
    }
    free(plan), free(first), free(fs), free(ds);
    return 0;
}
