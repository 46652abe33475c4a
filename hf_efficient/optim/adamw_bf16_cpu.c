/* AdamWBF16's step on CPU for bf16 weights: the operations of adamw_bf16.py's kernels, in their order,
 * one element at a time in plain C that the compiler vectorizes (built with -O3 -ffp-contract=off, so
 * no multiply-add is fused and every fp32 operation rounds as torch's eager ops do).
 *
 * Why not inductor: its C++ for this kernel is compute-bound on the hash and the stochastic rounding
 * (2.5x torch's fused fp32 AdamW step at 28M parameters); this loop is bound by memory.
 *
 * bf16 values travel as uint16_t. coef = beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^t), eps,
 * -lr * wd, lr / (1 - beta1^t). mode: 0 kahan, 1 stochastic, 2 none. Elements [start, end) of the tensor;
 * `start` numbers the noise, as torch.arange does in the Python kernels.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; NaN stays NaN */
    uint32_t b;
    memcpy(&b, &f, 4);
    uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

static inline float uniform(uint32_t key, uint32_t idx) { /* adamw_bf16._uniform */
    uint32_t h = idx * 0x9E3779B1u + key;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return (float)(int32_t)((h >> 8) & 0xFFFFFFu) * 5.9604644775390625e-08f; /* 2**-24 */
}

static inline float round_stochastic(float x, float noise) { /* adamw_bf16._round_stochastic, bf16 */
    float near = bf16_to_f32(f32_to_bf16(x));
    float err = x - near;
    float factor = err * near >= 0.0f ? 1.0048828125f : 0.9951171875f; /* 1 +- 0.625 * 2**-7 */
    float far = bf16_to_f32(f32_to_bf16(near * factor));
    return noise * fabsf(far - near) < fabsf(err) ? far : near;
}

/* One loop per mode (the mode a compile-time constant in each): a branch inside the loop would stop the
 * compiler from vectorizing it. */
#define ADAMW_BF16_LOOP(MODE)                                                                              \
    for (int64_t i = start; i < end; i++) {                                                               \
        float p32 = bf16_to_f32(p[i]);                                                                     \
        float g32 = bf16_to_f32(g[i]);                                                                     \
        float m32 = bf16_to_f32(m[i]) * b1 + g32 * omb1;                                                   \
        float v32 = bf16_to_f32(v[i]) * b2 + (g32 * g32) * omb2;                                           \
        m[i] = f32_to_bf16(m32);                                                                           \
        v[i] = f32_to_bf16(MODE == 2 ? v32 : round_stochastic(v32, uniform((uint32_t)key, (uint32_t)i)));  \
        float denom = sqrtf(v32) * inv_bc2 + eps;                                                          \
        float update = p32 * decay - (m32 / denom) * step_size;                                            \
        if (MODE == 0) {                                                                                   \
            float y = update + bf16_to_f32(c[i]);                                                          \
            uint16_t fresh = f32_to_bf16(p32 + y);                                                         \
            c[i] = f32_to_bf16(y - (bf16_to_f32(fresh) - p32));                                            \
            p[i] = fresh;                                                                                  \
        } else if (MODE == 1) {                                                                            \
            p[i] = f32_to_bf16(round_stochastic(p32 + update, uniform((uint32_t)weight_key, (uint32_t)i))); \
        } else {                                                                                           \
            p[i] = f32_to_bf16(p32 + update);                                                              \
        }                                                                                                  \
    }

void adamw_bf16_step(uint16_t *restrict p, const uint16_t *restrict g, uint16_t *restrict m,
                     uint16_t *restrict v, uint16_t *restrict c, const float *coef, int32_t key,
                     int32_t weight_key, int64_t start, int64_t end, int mode) {
    const float b1 = coef[0], omb1 = coef[1], b2 = coef[2], omb2 = coef[3];
    const float inv_bc2 = coef[4], eps = coef[5], decay = coef[6], step_size = coef[7];
    if (mode == 0) {
        ADAMW_BF16_LOOP(0)
    } else if (mode == 1) {
        ADAMW_BF16_LOOP(1)
    } else {
        ADAMW_BF16_LOOP(2)
    }
}
