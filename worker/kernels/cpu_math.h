/* Math shared by the CPU kernels (included by paged_decode.c and decode_stack.c). */
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

#endif
