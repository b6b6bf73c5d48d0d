/* Math shared by the CPU kernels (included by paged_decode.c, decode_stack.c and linear.c). */
#ifndef BATCHQ_CPU_MATH_H
#define BATCHQ_CPU_MATH_H
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (scores minus their max): 2^(x log2 e) split as 2^n * 2^f, |f| <= 1/2, with a
   degree-6 polynomial for 2^f (relative error ~2e-7, float32's own rounding). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_roundf(t);
    float f = t - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180944e-3f;
    p = p * f + 5.5503324e-2f;
    p = p * f + 2.4022648e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* float32 -> bfloat16, rounding to nearest even as torch's .to(torch.bfloat16) does. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float32 -> FP8 E4M3 (torch.float8_e4m3fn) as torch's CPU .to() converts: round to nearest even,
   saturating at +-448 (torch's CPU cast saturates; NaN stays NaN). Checked against torch over random bit
   patterns in tests/kernels/test_decode_stack.py. */
static inline uint8_t to_fp8(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u > 0x7F800000u) {
        r = 0x7F; /* NaN */
    } else if (u > 0x43E80000u) {
        r = 0x7E; /* past 464, where 448 would round up to 480, which E4M3FN lacks (its NaN): 448 */
    } else if (u < (121u << 23)) {
        /* below 2^-6, the smallest normal: the float addition to 2^-(141-127) rounds the subnormal */
        const uint32_t magic = 141u << 23;
        float a, m;
        memcpy(&a, &u, sizeof a);
        memcpy(&m, &magic, sizeof m);
        const float sum = a + m;
        uint32_t b;
        memcpy(&b, &sum, sizeof b);
        r = (uint8_t)(b - magic);
    } else {
        const uint32_t odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        r = (uint8_t)(u >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

/* One head's d values, divided by `div` (a per-tensor scale; 1 leaves them as they are), into row `row`
   (in elements) of a K or V cache of `elem` (0 float32, 1 bfloat16, 2 FP8 E4M3), converted as torch's
   .to() converts. The decode stack's cache writes and paged_decode.c's batchq_write_kv both go through it. */
static inline void store_kv_row(void *cache, size_t row, const float *x, int d, int elem, float div) {
    if (elem == 2) {
        uint8_t *c = (uint8_t *)cache + row;
        for (int i = 0; i < d; i++) c[i] = to_fp8(div != 1.0f ? x[i] / div : x[i]);
    } else if (elem == 1) {
        uint16_t *c = (uint16_t *)cache + row;
        for (int i = 0; i < d; i++) c[i] = to_bf16(div != 1.0f ? x[i] / div : x[i]);
    } else if (div != 1.0f) {
        float *c = (float *)cache + row;
        for (int i = 0; i < d; i++) c[i] = x[i] / div;
    } else {
        memcpy((float *)cache + row, x, sizeof(float) * d);
    }
}

/* act[i] = silu(gate[i]) * up[i] over n values. silu(x) = x / (1 + e^-x), written with e = e^-|x| so the
   exponential's argument is never positive: x / (1 + e) for x >= 0, x e / (1 + e) below. The polynomial
   exponential vectorises where expf would not (a layer's intermediate size of them per token, every
   layer); it differs from torch's SiLU by about one float32 rounding. The decode stack and the prompt
   path (linear.c's batchq_silu_mul) both take it, so a token's MLP computes the same in either. */
static inline void silu_mul(const float *gate, const float *up, float *act, long n) {
#pragma omp simd
    for (long i = 0; i < n; i++) {
        const float x = gate[i];
        const float e = exp_nonpositive(x >= 0.0f ? -x : x);
        act[i] = (x >= 0.0f ? x : x * e) / (1.0f + e) * up[i];
    }
}

/* act[i] = gelu(gate[i]) * up[i], torch's GELU: its tanh approximation (ACT_GELU_TANH, Gemma's
   gelu_pytorch_tanh) 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in torch's order of operations, or
   the exact 0.5 x (1 + erf(x / sqrt 2)); libm's tanhf / erff differ from torch's vectorised ones by about
   one float32 rounding. The decode stack and the prompt path (linear.c's batchq_gelu_mul) both
   take it, so a token's MLP computes the same in either, whatever else shares its step. */
static inline void gelu_mul(const float *gate, const float *up, float *act, long n, int tanh_form) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f, rsqrt2 = 0.7071067811865476f;
    for (long i = 0; i < n; i++) {
        const float x = gate[i];
        const float g = tanh_form ? 0.5f * x * (1.0f + tanhf(beta * (x + kappa * (x * x * x))))
                                  : x * 0.5f * (1.0f + erff(x * rsqrt2));
        act[i] = g * up[i];
    }
}

#endif
