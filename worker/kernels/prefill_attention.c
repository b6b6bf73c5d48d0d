/* Causal prompt attention for the CPU, float32: one sequence's new queries against its keys, flash-style.

   Built by worker/kernels/native_build.py with paged_decode.c, bound by native_attention.py.

   Why not torch: SDPA's CPU flash kernel ran SmolLM2's heads (D = 64, 9 over 3 kv heads) at a third of the
   FMA peak or less, and at the few hundred tokens of a typical prompt its per-call cost was as large as
   the arithmetic (`python benchmarks/kernel_bench.py --prefill-attention` compares the two).

   q: query position j's head h at q + j * q_row + h * d (heads d apart); k, v: kv head kh's key t at
   k + kh * k_head + t * k_row (likewise v); out: [n_q, heads, d] rows out_row apart, heads d apart.
   Query j sits at key position offset + j and sees keys 0 .. offset + j. scale multiplies q . k.

   How: a task is one kv head and QB query positions, i.e. R = QB x G query rows (the G heads sharing the
   kv head read the same keys). Keys go in blocks of KB: scores S = Q K^T of the block as register tiles
   (TR rows x 2 vectors of keys, over d, K^T packed once per call so that a vector of keys is one load),
   the online softmax per row (running max m and sum l, its earlier output rescaled by e^(m_old - m_new)),
   then O += P V as register tiles (TR rows x 2 vectors of d, over the block's keys, V read as stored).
   Every row takes its keys in the same blocks from key 0, whichever task, chunk of the prompt or rows
   beside it: a key a row does not see gets no score, a probability of exactly 0 and no rescale, so a
   row's answer is the same however the prompt is split into steps. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#ifdef __AVX512F__
#define VL 16
#define TR 12 /* query rows a tile: 24 accumulators + 2 loads of 32 registers (broadcasts fold into FMAs) */
#else
#define VL 8
#define TR 6 /* 12 accumulators + 2 loads + 1 broadcast <= 16 registers */
#endif
#define KB 64      /* keys a block: a multiple of 2 VL */
#ifndef QB
#define QB 16 /* query positions a task */
#endif
#define PF_MAX_D 256 /* native_attention.py's PREFILL_MAX_D */

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));

typedef struct {
    const float *q, *k, *v;
    float *out, *kt; /* kt: K^T by kv head and block, [kv_heads][blocks][d][KB], keys past n_k zero */
    long q_row, k_row, k_head, v_row, v_head, out_row;
    int n_q, n_k, offset, heads, kv_heads, d, blocks;
    float scale;
} Job;

/* S[i][c0 ..] = scale * (q row i . keys c0 .. c0 + 2 VL - 1 of the block), rows i < tr (tr <= TR), from the
   block's packed K^T (row stride KB). */
static inline __attribute__((always_inline)) void score_tile(const float *const *qp, const float *kt,
                                                             float *s, const int c0, const int d,
                                                             const int tr, const float scale) {
    vf acc[TR][2];
    for (int i = 0; i < tr; i++) acc[i][0] = acc[i][1] = (vf){0};
    for (int e = 0; e < d; e++) {
        const vf k0 = *(const vf *)(kt + (size_t)e * KB + c0), k1 = *(const vf *)(kt + (size_t)e * KB + c0 + VL);
        for (int i = 0; i < tr; i++) {
            const float x = qp[i][e];
            acc[i][0] += x * k0;
            acc[i][1] += x * k1;
        }
    }
    for (int i = 0; i < tr; i++) {
        *(vf *)(s + (size_t)i * KB + c0) = acc[i][0] * scale;
        *(vf *)(s + (size_t)i * KB + c0 + VL) = acc[i][1] * scale;
    }
}

/* O[i][c0 ..] = alpha[i] * O[i][c0 ..] + sum over the block's keys t < kn of P[i][t] * v[t][c0 ..], rows
   i < tr, nv <= 2 vectors of columns. */
static inline __attribute__((always_inline)) void value_tile(const float *p, const float *v, const long v_row,
                                                             float *o, const float *alpha, const int c0,
                                                             const int kn, const int d, const int tr,
                                                             const int nv) {
    vf acc[TR][2];
    for (int i = 0; i < tr; i++)
        for (int c = 0; c < nv; c++) acc[i][c] = *(const vf *)(o + (size_t)i * d + c0 + c * VL) * alpha[i];
    for (int t = 0; t < kn; t++) {
        const float *vr = v + (size_t)t * v_row + c0;
        const vf v0 = *(const vf *)vr, v1 = nv > 1 ? *(const vf *)(vr + VL) : (vf){0};
        for (int i = 0; i < tr; i++) {
            const float x = p[(size_t)i * KB + t];
            acc[i][0] += x * v0;
            if (nv > 1) acc[i][1] += x * v1;
        }
    }
    for (int i = 0; i < tr; i++)
        for (int c = 0; c < nv; c++) *(vf *)(o + (size_t)i * d + c0 + c * VL) = acc[i][c];
}

/* The tiles with tr a constant, so each keeps its accumulators in registers. */
#define TILE_CASES(CALL) \
    switch (tr) {        \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    case 4: CALL(4); break; \
    case 5: CALL(5); break; \
    case 6: CALL(6); break; \
    TILE_CASES_WIDE(CALL)   \
    }
#if TR > 6
#define TILE_CASES_WIDE(CALL) \
    case 7: CALL(7); break;   \
    case 8: CALL(8); break;   \
    case 9: CALL(9); break;   \
    case 10: CALL(10); break; \
    case 11: CALL(11); break; \
    case 12: CALL(12); break;
#else
#define TILE_CASES_WIDE(CALL)
#endif

static __attribute__((noinline)) void scores(const float *const *qp, const float *kt, float *s, const int c0,
                                             const int d, const int tr, const float scale) {
#define SCORE(n) score_tile(qp, kt, s, c0, d, n, scale)
    TILE_CASES(SCORE)
#undef SCORE
}

static __attribute__((noinline)) void values(const float *p, const float *v, const long v_row, float *o,
                                             const float *alpha, const int c0, const int kn, const int d,
                                             const int tr, const int nv) {
#define VALUE(n)                                                       \
    if (nv > 1) value_tile(p, v, v_row, o, alpha, c0, kn, d, n, 2);    \
    else value_tile(p, v, v_row, o, alpha, c0, kn, d, n, 1)
    TILE_CASES(VALUE)
#undef VALUE
}

/* Scratch of one thread for tasks of up to rows query rows of d. */
typedef struct {
    float *s, *o, *m, *l, *alpha;
    const float **qp;
    int *seen;
} Scratch;

/* Query positions a .. b - 1 of kv head kh. */
static void task(const Job *job, const int kh, const int a, const int b, const Scratch *w) {
    const int g_count = job->heads / job->kv_heads, d = job->d, rows = (b - a) * g_count;
    for (int r = 0; r < rows; r++) {
        const int j = a + r / g_count, h = kh * g_count + r % g_count;
        w->qp[r] = job->q + (size_t)j * job->q_row + (size_t)h * d;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)rows * d);
    const int last_key = job->offset + b - 1; /* what the task's last row sees */
    for (int kb = 0; kb * KB <= last_key; kb++) {
        const int k0 = kb * KB, kn = job->n_k - k0 < KB ? job->n_k - k0 : KB;
        const float *kt = job->kt + ((size_t)kh * job->blocks + kb) * d * KB;
        /* scores for the keys the task's last row sees, in whole tiles of keys (the rest are never read) */
        const int need = last_key - k0 + 1 < kn ? last_key - k0 + 1 : kn;
        const int cols = (need + 2 * VL - 1) / (2 * VL) * (2 * VL);
        for (int r0 = 0; r0 < rows; r0 += TR) {
            const int tr = rows - r0 < TR ? rows - r0 : TR;
            for (int c0 = 0; c0 < cols; c0 += 2 * VL)
                scores(w->qp + r0, kt, w->s + (size_t)r0 * KB, c0, d, tr, job->scale);
        }
        /* the online softmax: each row's scores of the keys it sees become probabilities under its running
           max, the rest exactly 0 */
        for (int r = 0; r < rows; r++) {
            const int pos = job->offset + a + r / g_count, seen = pos - k0 + 1 < kn ? pos - k0 + 1 : kn;
            float *s = w->s + (size_t)r * KB, mx = w->m[r], sum = 0.0f;
            w->seen[r] = seen > 0 ? seen : 0;
            if (seen <= 0) {
                memset(s, 0, sizeof(float) * KB);
                w->alpha[r] = 1.0f;
                continue;
            }
#pragma omp simd reduction(max : mx)
            for (int t = 0; t < seen; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < seen; t++) {
                s[t] = exp_nonpositive(s[t] - mx);
                sum += s[t];
            }
            for (int t = seen; t < KB; t++) s[t] = 0.0f;
            const float alpha = w->m[r] == -INFINITY ? 0.0f : exp_nonpositive(w->m[r] - mx);
            w->alpha[r] = alpha;
            w->l[r] = w->l[r] * alpha + sum;
            w->m[r] = mx;
        }
        const float *v = job->v + (size_t)kh * job->v_head + (size_t)k0 * job->v_row;
        for (int r0 = 0; r0 < rows; r0 += TR) {
            const int tr = rows - r0 < TR ? rows - r0 : TR;
            int used = 0; /* keys any row of the tile sees */
            for (int i = 0; i < tr; i++) used = w->seen[r0 + i] > used ? w->seen[r0 + i] : used;
            for (int c0 = 0; c0 < d; c0 += 2 * VL)
                values(w->s + (size_t)r0 * KB, v, job->v_row, w->o + (size_t)r0 * d, w->alpha + r0, c0, used,
                       d, tr, d - c0 >= 2 * VL ? 2 : 1);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int j = a + r / g_count, h = kh * g_count + r % g_count;
        float *out = job->out + (size_t)j * job->out_row + (size_t)h * d;
        const float inv = 1.0f / w->l[r];
        for (int e = 0; e < d; e += VL) *(vf *)(out + e) = *(const vf *)(w->o + (size_t)r * d + e) * inv;
    }
}

/* Returns 0, or -1 when memory for the packed keys or a thread's scratch could not be had (out is then
   incomplete; the caller falls back to torch), or -2 for a shape it does not take (d not a multiple of
   VL or above PF_MAX_D, heads not a multiple of kv_heads). Threads: torch's OpenMP pool. */
int batchq_prefill_attention(const float *q, const float *k, const float *v, float *out, long q_row, long k_row,
                             long k_head, long v_row, long v_head, long out_row, int n_q, int n_k, int offset,
                             int heads, int kv_heads, int d, float scale, int threads) {
    if (d % VL || d > PF_MAX_D || kv_heads < 1 || heads % kv_heads || n_q < 1 || offset + n_q > n_k) return -2;
    const int blocks = (n_k + KB - 1) / KB, g_count = heads / kv_heads, qbs = (n_q + QB - 1) / QB;
    float *kt = malloc(sizeof(float) * (size_t)kv_heads * blocks * d * KB);
    if (kt == NULL) return -1;
    const Job job = {q, k, v, out, kt, q_row, k_row, k_head, v_row, v_head, out_row,
                     n_q, n_k, offset, heads, kv_heads, d, blocks, scale};
    const int rows_max = QB * g_count;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < kv_heads * blocks; i++) {
            const int kh = i / blocks, kb = i % blocks, k0 = kb * KB, kn = n_k - k0 < KB ? n_k - k0 : KB;
            float *dst = kt + (size_t)i * d * KB;
            const float *src = k + (size_t)kh * k_head + (size_t)k0 * k_row;
            if (kn < KB) memset(dst, 0, sizeof(float) * (size_t)d * KB);
            for (int t = 0; t < kn; t++)
                for (int e = 0; e < d; e++) dst[(size_t)e * KB + t] = src[(size_t)t * k_row + e];
        }
        Scratch w;
        w.s = aligned_alloc(64, sizeof(float) * (size_t)rows_max * KB);
        w.o = aligned_alloc(64, sizeof(float) * (size_t)rows_max * d);
        w.m = malloc(sizeof(float) * 3 * (size_t)rows_max);
        w.qp = malloc(sizeof(float *) * (size_t)rows_max);
        w.seen = malloc(sizeof(int) * (size_t)rows_max);
        const int ok = w.s && w.o && w.m && w.qp && w.seen;
        if (ok) w.l = w.m + rows_max, w.alpha = w.m + 2 * rows_max;
#pragma omp barrier
        /* the tasks with the most keys first: the last query blocks */
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < kv_heads * qbs; i++) {
            const int qb = qbs - 1 - i / kv_heads, kh = i % kv_heads;
            const int a = qb * QB, b = a + QB < n_q ? a + QB : n_q;
            if (ok) task(&job, kh, a, b, &w);
        }
        failed = !ok;
        free(w.s);
        free(w.o);
        free(w.m);
        free((void *)w.qp);
        free(w.seen);
    }
    free(kt);
    return failed ? -1 : 0;
}
