/* Paged decode attention for the CPU, reading each sequence's K/V blocks in place.

   Built by worker/kernels/native_build.py (cc -O3 -march=native -fopenmp), bound by native_attention.py.
   Vector loops use GCC/Clang vector extensions, threads come from torch's OpenMP pool.

   Cache layout (one layer), as in torch_attention.py: k, v [kv_heads, num_blocks, block_size, head_dim].
   One task = one (sequence, kv head): its G = heads / kv_heads query rows share every K/V row read.
   Per task: scores = q . k for each context token (K read once), softmax in float32, then
   out = sum_t p_t v_t (V read once). The torch path instead copies every block into a workspace
   before two batched matmuls; this kernel reads ~1/3 of the bytes that path moves.

   q: [B, H, D] float32, already scaled; out: [B, H, D] float32; k, v: float32, bfloat16 or FP8 E4M3
   (elem), widened to float32 as they are read;
   block_tables: [B, W] int32; context_lens: [B] int32.
   D must be a multiple of 16 and at most MAX_D; G at most MAX_G (native_attention.py checks).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define MAX_D 256
#define MAX_G 16

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline v16 load_f32(const float *p) { return *(const v16 *)p; }

static inline v16 load_bf16(const uint16_t *p) {
    u32x16 wide = __builtin_convertvector(*(const u16x16 *)p, u32x16) << 16;
    return (v16)wide;
}

/* FP8 E4M3 (torch.float8_e4m3fn: bias 7, no infinities) -> float32. Its exponent and mantissa bits, moved
   to float32's positions, read as a float32 with bias 127: times 2^120 that is the value, subnormals
   included (they land on float32 subnormals, exact). The cache never holds NaN (writes are clamped). */
static inline v16 load_fp8(const uint8_t *p) {
    u32x16 w = __builtin_convertvector(*(const u8x16 *)p, u32x16);
    u32x16 bits = ((w & 0x7F) << 20) | ((w & 0x80) << 24);
    return (v16)bits * 0x1p120f;
}

enum { F32 = 0, BF16 = 1, FP8 = 2 }; /* the cache's element type */

static inline v16 load_row(const char *p, const int elem) {
    return elem == BF16 ? load_bf16((const uint16_t *)p) : elem == FP8 ? load_fp8((const uint8_t *)p)
                                                                       : load_f32((const float *)p);
}

/* The sum of 16 lanes by halving: 4 shuffle-adds (a loop of 16 scalar adds is a 16-add dependency chain per
   score, a large share of the attention time). */
static inline float hsum(v16 x) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    q += __builtin_shufflevector(q, q, 2, 3, 0, 1);
    return q[0] + q[1];
}

typedef struct {
    const float *q;
    const void *k, *v;
    float *out, *lse;
    const int32_t *block_tables, *context_lens;
    int batch, heads, kv_heads, head_dim, block_size, num_blocks, width, max_len;
} Job;

/* One (sequence, kv head). Always inlined into task(), which calls it with literal (G, D, elem) for
   the common shapes, so their loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void task_body(const Job *job, int b, int kh, float *scores,
                                                            const int g_count, const int d, const int elem) {
    const int nv = d / 16, bs = job->block_size, n = job->context_lens[b], stride = job->max_len;
    const size_t el = elem == BF16 ? 2 : elem == FP8 ? 1 : 4;
    const float *q = job->q + ((size_t)b * job->heads + (size_t)kh * g_count) * d;
    const size_t head_off = (size_t)kh * job->num_blocks * bs * d;
    const char *kbase = (const char *)job->k + head_off * el, *vbase = (const char *)job->v + head_off * el;
    const int32_t *table = job->block_tables + (size_t)b * job->width;
    const char *row = kbase;
    v16 qv[MAX_G * MAX_D / 16], acc[MAX_G * MAX_D / 16];
    for (int i = 0; i < g_count * nv; i++) qv[i] = load_f32(q + 16 * i);
    for (int t = 0; t < n; t++) {
        if (t % bs == 0) row = kbase + (size_t)table[t / bs] * bs * d * el;
        const char *kr = row + (size_t)(t % bs) * d * el;
        v16 kc[MAX_D / 16];
        for (int c = 0; c < nv; c++)
            kc[c] = load_row(kr + 16 * c * el, elem);
        for (int g = 0; g < g_count; g++) {
            v16 a = qv[g * nv] * kc[0];
            for (int c = 1; c < nv; c++) a += qv[g * nv + c] * kc[c];
            scores[g * stride + t] = hsum(a);
        }
    }
    for (int g = 0; g < g_count; g++) {
        float *s = scores + g * stride, mx = -INFINITY, sum = 0.0f;
        for (int t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < n; t++) {
            s[t] = exp_nonpositive(s[t] - mx);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int t = 0; t < n; t++) s[t] *= inv;
        if (job->lse != NULL) job->lse[(size_t)b * job->heads + (size_t)kh * g_count + g] = mx + logf(sum);
    }
    for (int i = 0; i < g_count * nv; i++) acc[i] = (v16){0};
    for (int t = 0; t < n; t++) {
        if (t % bs == 0) row = vbase + (size_t)table[t / bs] * bs * d * el;
        const char *vr = row + (size_t)(t % bs) * d * el;
        for (int c = 0; c < nv; c++) {
            const v16 x = load_row(vr + 16 * c * el, elem);
            for (int g = 0; g < g_count; g++) acc[g * nv + c] += scores[g * stride + t] * x;
        }
    }
    float *o = job->out + ((size_t)b * job->heads + (size_t)kh * g_count) * d;
    for (int i = 0; i < g_count * nv; i++) *(v16 *)(o + 16 * i) = acc[i];
}

/* One function per common (G, D) and element type, each compiled on its own: inlined together into one
   function, the shapes made the compiler's work superlinear (minutes of build time). */
#define SHAPE(G, D)                                                                                 \
    static __attribute__((noinline)) void task_##G##_##D##_f32(const Job *job, int b, int kh, float *s) { \
        task_body(job, b, kh, s, G, D, F32);                                                        \
    }                                                                                               \
    static __attribute__((noinline)) void task_##G##_##D##_bf16(const Job *job, int b, int kh, float *s) { \
        task_body(job, b, kh, s, G, D, BF16);                                                       \
    }                                                                                               \
    static __attribute__((noinline)) void task_##G##_##D##_fp8(const Job *job, int b, int kh, float *s) { \
        task_body(job, b, kh, s, G, D, FP8);                                                        \
    }
#define SHAPES(D) SHAPE(1, D) SHAPE(2, D) SHAPE(3, D) SHAPE(4, D) SHAPE(5, D) SHAPE(6, D) SHAPE(7, D) SHAPE(8, D)
SHAPES(64)
SHAPES(128)

typedef void (*TaskFn)(const Job *, int, int, float *);
#define ROW(D, T) {task_1_##D##_##T, task_2_##D##_##T, task_3_##D##_##T, task_4_##D##_##T, \
                   task_5_##D##_##T, task_6_##D##_##T, task_7_##D##_##T, task_8_##D##_##T}
static const TaskFn TASKS[2][3][8] = {{ROW(64, f32), ROW(64, bf16), ROW(64, fp8)},
                                      {ROW(128, f32), ROW(128, bf16), ROW(128, fp8)}};

/* The specialised function for (G, D, element type), or NULL: the generic body then runs. */
static TaskFn specialised(int g_count, int d, int elem) {
    if (g_count < 1 || g_count > 8 || (d != 64 && d != 128)) return NULL;
    return TASKS[d == 128][elem][g_count - 1];
}

static void task(const Job *job, int b, int kh, float *scores, int elem) {
    TaskFn fn = specialised(job->heads / job->kv_heads, job->head_dim, elem);
    if (fn != NULL)
        fn(job, b, kh, scores);
    else if (elem == BF16)
        task_body(job, b, kh, scores, job->heads / job->kv_heads, job->head_dim, BF16);
    else if (elem == FP8)
        task_body(job, b, kh, scores, job->heads / job->kv_heads, job->head_dim, FP8);
    else
        task_body(job, b, kh, scores, job->heads / job->kv_heads, job->head_dim, F32);
}

/* Task i = (sequence i / kv_heads, kv head i % kv_heads) of batchq_paged_decode, alone: decode_stack.c
   runs the tasks of every layer inside its own parallel region. scores: G * max_len floats. */
void batchq_paged_decode_task(const float *q, const void *k, const void *v, float *out,
                              const int32_t *block_tables, const int32_t *context_lens, int batch, int heads,
                              int kv_heads, int head_dim, int block_size, int num_blocks, int width, int max_len,
                              int elem, int i, float *scores) {
    const Job job = {q, k, v, out, NULL, block_tables, context_lens, batch, heads, kv_heads, head_dim,
                     block_size, num_blocks, width, max_len};
    task(&job, i / kv_heads, i % kv_heads, scores, elem);
}

/* lse: NULL, or [batch, heads] floats that receive each row's log-sum-exp of its (scaled) scores, which
   lets the caller merge this attention with another over other keys (cascade attention).
   Returns 0, or -1 when a thread could not allocate its scores and its tasks never ran (the caller
   then falls back to torch). Threads come from OpenMP: native_build.py links the libgomp that torch already
   loaded, so this reuses torch's thread pool (a second pool would fight its spinning threads for the
   cores). */
int batchq_paged_decode(const float *q, const void *k, const void *v, float *out, float *lse,
                        const int32_t *block_tables, const int32_t *context_lens, int batch, int heads,
                        int kv_heads, int head_dim, int block_size, int num_blocks, int width, int max_len,
                        int elem, int threads) {
    const Job job = {q, k, v, out, lse, block_tables, context_lens, batch, heads, kv_heads, head_dim,
                     block_size, num_blocks, width, max_len};
    const int tasks = batch * kv_heads, g_count = heads / kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)g_count * max_len);
        failed = scores == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < tasks; i++)
            if (scores != NULL) task(&job, i / kv_heads, i % kv_heads, scores, elem);
        free(scores);
    }
    return failed ? -1 : 0;
}
