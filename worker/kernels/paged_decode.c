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
   window > 0: a sliding window, the last `window` tokens of each context (the query's own included): the
   loops start there, so the blocks before it are never read (their table entries may name any block).
   softcap > 0: attention-logit soft-capping, score = softcap * tanh(score / softcap) before the softmax.
   D must be a multiple of 16 and at most MAX_D; G at most MAX_G (native_attention.py checks).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define MAX_D 256
#define MAX_G 16

/* Vectors of the instruction set's width (AVX-512: 16 floats and 32 registers; otherwise 8 and 16), so
   the per-task working set below is sized to the register file it runs on: 16-float vectors on AVX2
   compile to pairs of registers, and G query rows held across the token loop spilled to the stack. */
#ifdef __AVX512F__
#define VL 16
#define ACC_REGS 32 /* accumulators of the V loop (32 registers; the scores broadcast from memory) */
#define KC_REGS 16  /* a K row held in registers, at most */
#else
#define VL 8
#define ACC_REGS 12 /* of 16 */
#define KC_REGS 8
#endif
typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t u16v __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint8_t u8v __attribute__((vector_size(VL), aligned(1)));
typedef uint32_t u32v __attribute__((vector_size(VL * 4)));

static inline vf load_f32(const float *p) { return *(const vf *)p; }

static inline vf load_bf16(const uint16_t *p) {
    u32v wide = __builtin_convertvector(*(const u16v *)p, u32v) << 16;
    return (vf)wide;
}

/* FP8 E4M3 (torch.float8_e4m3fn: bias 7, no infinities) -> float32. Its exponent and mantissa bits, moved
   to float32's positions, read as a float32 with bias 127: times 2^120 that is the value, subnormals
   included (they land on float32 subnormals, exact). The cache never holds NaN (writes are clamped). */
static inline vf load_fp8(const uint8_t *p) {
    u32v w = __builtin_convertvector(*(const u8v *)p, u32v);
    u32v bits = ((w & 0x7F) << 20) | ((w & 0x80) << 24);
    return (vf)bits * 0x1p120f;
}

enum { F32 = 0, BF16 = 1, FP8 = 2 }; /* the cache's element type */

static inline vf load_row(const char *p, const int elem) {
    return elem == BF16 ? load_bf16((const uint16_t *)p) : elem == FP8 ? load_fp8((const uint8_t *)p)
                                                                       : load_f32((const float *)p);
}

/* The sum of the lanes by halving: shuffle-adds (a loop of scalar adds is a dependency chain per score, a
   large share of the attention time). */
static inline float hsum(vf x) {
    typedef float v4 __attribute__((vector_size(16)));
#if VL == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf h = x;
#endif
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
    int window;    /* > 0: keys of the last `window` positions only */
    float softcap; /* > 0: scores soft-capped */
    const float *sinks; /* NULL, or [heads]: a logit per head in the softmax's denominator (gpt-oss) */
} Job;

/* One (sequence, kv head). Always inlined into task(), which calls it with literal (G, D, elem) for
   the common shapes, so their loops unroll and the accumulators stay in registers.
   Scores: each K row is read once from memory (into registers, where it fits) and dotted with the G query
   rows, which are read from L1 at every token (the empty asm keeps the compiler from hoisting them into
   more registers than exist).
   Output: the V rows are read in chunks of columns small enough that G x chunk accumulators fit in
   ACC_REGS registers; with more chunks than one, later chunks reread the rows from L1/L2. */
static inline __attribute__((always_inline)) void task_body(const Job *job, int b, int kh, float *scores,
                                                            const int g_count, const int d, const int elem) {
    const int nv = d / VL, bs = job->block_size, ctx = job->context_lens[b], stride = job->max_len;
    const int t0 = job->window > 0 && ctx > job->window ? ctx - job->window : 0; /* the first key it sees */
    const int n = ctx - t0;                                                       /* keys, scores[0..n) */
    const size_t el = elem == BF16 ? 2 : elem == FP8 ? 1 : 4;
    const float *q = job->q + ((size_t)b * job->heads + (size_t)kh * g_count) * d;
    const size_t head_off = (size_t)kh * job->num_blocks * bs * d;
    const char *kbase = (const char *)job->k + head_off * el, *vbase = (const char *)job->v + head_off * el;
    const int32_t *table = job->block_tables + (size_t)b * job->width;
    const char *row = kbase;
    for (int j = 0; j < n; j++) {
        const int t = t0 + j;
        if (j == 0 || t % bs == 0) row = kbase + (size_t)table[t / bs] * bs * d * el;
        const char *kr = row + (size_t)(t % bs) * d * el;
        const float *qr = q;
        __asm__("" : "+r"(qr));
        if (nv <= KC_REGS) { /* the K row in registers, widened once */
            vf kc[KC_REGS];
            for (int c = 0; c < nv; c++) kc[c] = load_row(kr + c * VL * el, elem);
            for (int g = 0; g < g_count; g++) {
                vf a = load_f32(qr + (size_t)g * d) * kc[0];
                for (int c = 1; c < nv; c++) a += load_f32(qr + (size_t)g * d + c * VL) * kc[c];
                scores[g * stride + j] = hsum(a);
            }
        } else { /* a row wider than the registers: reread (from L1) per query row */
            for (int g = 0; g < g_count; g++) {
                vf a = load_f32(qr + (size_t)g * d) * load_row(kr, elem);
                for (int c = 1; c < nv; c++)
                    a += load_f32(qr + (size_t)g * d + c * VL) * load_row(kr + c * VL * el, elem);
                scores[g * stride + j] = hsum(a);
            }
        }
    }
    for (int g = 0; g < g_count; g++) {
        float *s = scores + g * stride, mx = -INFINITY, sum = 0.0f;
        if (job->softcap > 0.0f) {
            const float cap = job->softcap, inv_cap = 1.0f / cap;
            for (int t = 0; t < n; t++) s[t] = cap * tanhf(s[t] * inv_cap);
        }
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
        /* The sink joins the denominator: p * S / (S + e^sink), S = e^lse, i.e. the weights times
           1 / (1 + e^(sink - lse)), in the row's own code so its bits never follow the batch. */
        if (job->sinks != NULL) {
            const float keep = 1.0f / (1.0f + expf(job->sinks[kh * g_count + g] - (mx + logf(sum))));
#pragma omp simd
            for (int t = 0; t < n; t++) s[t] *= keep;
        }
    }
    float *o = job->out + ((size_t)b * job->heads + (size_t)kh * g_count) * d;
    int chunk = ACC_REGS / g_count < 1 ? 1 : ACC_REGS / g_count < nv ? ACC_REGS / g_count : nv;
    while (nv % chunk != 0) chunk--; /* equal chunks: a constant trip count in the specialised shapes */
    for (int c0 = 0; c0 < nv; c0 += chunk) {
        vf acc[MAX_G][MAX_D / VL];
        for (int g = 0; g < g_count; g++)
            for (int c = 0; c < chunk; c++) acc[g][c] = (vf){0};
        for (int j = 0; j < n; j++) {
            const int t = t0 + j;
            if (j == 0 || t % bs == 0) row = vbase + (size_t)table[t / bs] * bs * d * el;
            const char *vr = row + (size_t)(t % bs) * d * el + (size_t)c0 * VL * el;
            for (int c = 0; c < chunk; c++) {
                const vf x = load_row(vr + c * VL * el, elem);
                for (int g = 0; g < g_count; g++) acc[g][c] += scores[g * stride + j] * x;
            }
        }
        for (int g = 0; g < g_count; g++)
            for (int c = 0; c < chunk; c++) *(vf *)(o + (size_t)g * d + (c0 + c) * VL) = acc[g][c];
    }
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
                              int elem, int window, float softcap, int i, float *scores) {
    const Job job = {q, k, v, out, NULL, block_tables, context_lens, batch, heads, kv_heads, head_dim,
                     block_size, num_blocks, width, max_len, window, softcap, NULL};
    task(&job, i / kv_heads, i % kv_heads, scores, elem);
}

/* lse: NULL, or [batch, heads] floats that receive each row's log-sum-exp of its (scaled) scores, which
   lets the caller merge this attention with another over other keys (cascade attention). sinks: NULL, or
   [heads] floats, a logit per head in the softmax's denominator (the output is then the sunk one; lse
   still the scores' own).
   Returns 0, or -1 when a thread could not allocate its scores and its tasks never ran (the caller
   then falls back to torch). Threads come from OpenMP: native_build.py links the libgomp that torch already
   loaded, so this reuses torch's thread pool (a second pool would fight its spinning threads for the
   cores). */
int batchq_paged_decode(const float *q, const void *k, const void *v, float *out, float *lse,
                        const int32_t *block_tables, const int32_t *context_lens, int batch, int heads,
                        int kv_heads, int head_dim, int block_size, int num_blocks, int width, int max_len,
                        int elem, int window, float softcap, const float *sinks, int threads) {
    const Job job = {q, k, v, out, lse, block_tables, context_lens, batch, heads, kv_heads, head_dim,
                     block_size, num_blocks, width, max_len, window, softcap, sinks};
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

/* This step's K or V into one layer's paged cache: token t's kv_heads heads of D values (x: row stride
   row_stride, head stride head_stride, in floats) into slot slots[t] (block * block_size + offset) of
   every kv head, cache [kv_heads, nbs slots, D] of `elem`, converted as torch's .to() converts (bfloat16:
   to nearest even; FP8: saturating). What the torch path's transpose, cast and index_copy_ write, in one
   pass: that chain over a fused QKV output's strided K and V cost a prompt step as much as its SiLU. */
void batchq_write_kv(const float *x, long row_stride, long head_stride, const int64_t *slots, int T,
                     int kv_heads, int D, void *cache, long nbs, int elem) {
#pragma omp parallel for if ((long)T * kv_heads * D > (1L << 16)) schedule(static)
    for (int t = 0; t < T; t++)
        for (int h = 0; h < kv_heads; h++)
            store_kv_row(cache, ((size_t)h * nbs + (size_t)slots[t]) * D,
                         x + (size_t)t * row_stride + (size_t)h * head_stride, D, elem, 1.0f);
}
