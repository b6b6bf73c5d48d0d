/* A whole decode step of a Llama-family decoder on the CPU, every layer in one call.

   Built by worker/kernels/native_build.py together with linear.c and paged_decode.c, whose per-thread
   pieces it calls (batchq_linear_part_w, batchq_paged_decode_task, the RMSNorm and rotary rows), and bound
   by native_stack.py: the arithmetic is theirs, so a step computes what the layer-by-layer path computes,
   in the same order (the SiLU excepted, see silu_mul in cpu_math.h).

   Why: at decode sizes the layer-by-layer path spends more time between its kernels than in them: one
   SmolLM2-135M step is ~1,000 torch ops, ~120 ctypes calls and as many OpenMP fork/joins, several times
   the time its weights take to stream (issue #21). Here one OpenMP region runs the whole stack; the
   phases of a layer are separated by barriers (about a microsecond each).

   Per layer, for M decode rows (one token per sequence), h [M, hidden] updated in place:
     xn = rmsnorm(h)                         rows split over threads
     qkv = xn Wqkv^T (+ b)                   output columns split (linear.c streams each weight once)
     q, k: per-head RMSNorm (Qwen3), rotary; q scaled into qs; k, v written to the paged cache
     att = attention(qs, cache)              (sequence, kv head) tasks, dynamic (paged_decode.c), within the
                                             layer's sliding window and soft-capped where it has them
     h += att Wo^T (+ b)                     the residual added in the linear's epilogue
     xn = rmsnorm(h)
     gu = xn Wgu^T (+ b); act = silu(gate) * up   (GELU, tanh or exact, in Gemma's)
     h += act Wdown^T (+ b)
   then out = rmsnorm(h) with the final norm.

   Gemma 2 / 3 norm each sublayer's output too (post_attn, post_ff): o and down then write into xn, and
   h += rmsnorm(xn) follows; their norms' weights arrive as 1 + w (float32, llama.py's RMSNorm.scale), and
   Gemma 3's sliding layers rotate by their own table (cos_local, sin_local).

   Caches: [kv_heads, num_blocks, block_size, head_dim], float32, bfloat16 or FP8 E4M3 (kv_elem 0, 1, 2:
   paged_decode.c's), written rounded as torch's .to() rounds. An FP8 cache holds K / k_scale and
   V / v_scale (per-layer scales, kv_pool.calibrate_kv_scales): q is scaled by the softmax scale times
   k_scale, and the attention output multiplied by v_scale, as llama.py's Attention does. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"
#include "linear.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* linear.c (batchq_linear_part_w is linear.h's) */
void batchq_rmsnorm_row(const float *x, const float *w, float *y, int D, float eps);
void batchq_rotary_head(float *v, const float *c, const float *s, int D);
/* paged_decode.c */
void batchq_paged_decode_task(const float *q, const void *k, const void *v, float *out,
                              const int32_t *block_tables, const int32_t *context_lens, int batch, int heads,
                              int kv_heads, int head_dim, int block_size, int num_blocks, int width, int max_len,
                              int elem, int window, float softcap, int i, float *scores);


typedef struct {
    LinearWeight qkv, o, gate_up, down; /* linear.h: any weight linear.c reads */
    const float *ln1, *ln2;       /* input_layernorm, post_attention_layernorm: [hidden] */
    const float *q_norm, *k_norm; /* [head_dim] (Qwen3) or NULL */
    void *k_cache, *v_cache;
    float q_scale;          /* the softmax scale times k_scale */
    float k_scale, v_scale; /* the cache holds K / k_scale, V / v_scale (1 but for FP8) */
    int window;             /* > 0: the layer's sliding window (paged_decode.c's) */
    float softcap;          /* > 0: its attention-logit soft-capping */
    const float *post_attn, *post_ff; /* norms of attention's and the MLP's outputs (Gemma), or NULL */
    int act;                /* the MLP's activation: ACT_SILU, ACT_GELU_TANH, ACT_GELU */
    int local_rope;         /* 1: rotated by cos_local / sin_local (Gemma 3's sliding layers) */
} Layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2 };

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps; /* RMSNorm epsilon */
    int kv_elem, num_blocks, block_size;
    const float *final_norm; /* [hidden] */
} Spec;

#define ALIGN_FLOATS 16 /* every workspace array starts on a 64-byte line */

static long aligned(long n) { return (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS; }

/* The workspace's arrays, in floats, in the order decode_stack lays them out. */
typedef struct {
    long xn, qkv, qs, att, gu, act, scores_per_thread;
} Sizes;

static Sizes sizes(const Spec *s, int M, int max_len) {
    const long q = (long)s->heads * s->head_dim, kv = (long)s->kv_heads * s->head_dim;
    Sizes z = {aligned((long)M * s->hidden), aligned(M * (q + 2 * kv)), aligned(M * q), aligned(M * q),
               aligned(2L * M * s->inter), aligned((long)M * s->inter),
               aligned((long)(s->heads / s->kv_heads) * (max_len > 0 ? max_len : 1))};
    return z;
}

/* The workspace decode_stack needs, in floats. */
long batchq_decode_stack_workspace(const Spec *s, int M, int max_len, int threads) {
    const Sizes z = sizes(s, M, max_len);
    return z.xn + z.qkv + z.qs + z.att + z.gu + z.act + (long)(threads > 0 ? threads : 1) * z.scores_per_thread;
}

/* Exported for the test against torch: n values converted. */
void batchq_to_fp8(const float *x, uint8_t *y, long n) {
    for (long i = 0; i < n; i++) y[i] = to_fp8(x[i]);
}

/* One head's D values, divided by `div` (a per-tensor scale; 1 leaves them as they are), into the cache
   row of `slot` (block * block_size + offset) of kv head kh. */
static inline void write_cache(void *cache, const Spec *s, int kh, int64_t slot, const float *x, float div) {
    const int d = s->head_dim;
    store_kv_row(cache, ((size_t)kh * s->num_blocks * s->block_size + (size_t)slot) * d, x, d, s->kv_elem, div);
}

/* h += rmsnorm(y) for one row of h and y (y normed in place): a sublayer's output norm (Gemma). */
static void add_normed(float *h, float *y, const float *w, int hid, float eps) {
    batchq_rmsnorm_row(y, w, y, hid, eps);
    for (int i = 0; i < hid; i++) h[i] += y[i];
}

/* A sublayer's output linear (this thread's share, inside the parallel region) into the residual stream h:
   added straight to h, or, with an output norm (Gemma's post_*), into xn first and then h += rmsnorm(xn).
   Ends on a barrier: h is whole for the next sublayer. */
static void residual_out(const float *in, const LinearWeight *w, int K, const float *post, float *h, float *xn,
                         int M, int hid, float eps, int t, int nt, const LinearTuning *tuning) {
    if (post) {
        batchq_linear_part_w(in, w, xn, M, K, hid, t, nt, 0, tuning);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) add_normed(h + (size_t)m * hid, xn + (size_t)m * hid, post, hid, eps);
    } else {
        batchq_linear_part_w(in, w, h, M, K, hid, t, nt, 1, tuning);
#pragma omp barrier
    }
}

/* h: [M, hidden] float32, the embedded tokens in, the last layer's residual stream out; out: [M, hidden]
   receives rmsnorm(h) with the final norm. cos, sin: [M, head_dim] each row's rotary factors; cos_local,
   sin_local: the same of the local table (layers with local_rope; NULL where none has it); slots: [M]
   cache slots of the new tokens; block_tables: [M, width]; context_lens: [M] (this token included);
   max_len: the largest context; ws: batchq_decode_stack_workspace(...) floats; tuning: how linear.c
   streams the weights (linear.h). Returns 0. */
int batchq_decode_stack(const Spec *s, const Layer *layers, float *h, float *out, int M, const float *cos,
                        const float *sin, const float *cos_local, const float *sin_local, const int64_t *slots,
                        const int32_t *block_tables, const int32_t *context_lens, int width, int max_len, float *ws,
                        int threads, const LinearTuning *tuning) {
    const int H = s->heads, KVH = s->kv_heads, D = s->head_dim, I = s->inter, hid = s->hidden;
    const int q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
    const Sizes z = sizes(s, M, max_len);
    float *xn = ws, *qkv = xn + z.xn, *qs = qkv + z.qkv, *att = qs + z.qs, *gu = att + z.att, *act = gu + z.gu;
    float *scores0 = act + z.act;
    const int nthreads = threads > 0 ? threads : 1;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        float *scores = scores0 + (size_t)t * z.scores_per_thread;
        for (int l = 0; l < s->num_layers; l++) {
            const Layer *L = layers + l;
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) batchq_rmsnorm_row(h + (size_t)m * hid, L->ln1, xn + (size_t)m * hid, hid, s->eps);
            batchq_linear_part_w(xn, &L->qkv, qkv, M, hid, nqkv, t, nt, 0, tuning);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                float *row = qkv + (size_t)m * nqkv;
                const float *c = (L->local_rope ? cos_local : cos) + (size_t)m * D;
                const float *sn = (L->local_rope ? sin_local : sin) + (size_t)m * D;
                for (int hh = 0; hh < H; hh++) {
                    float *qh = row + (size_t)hh * D, *dst = qs + ((size_t)m * H + hh) * D;
                    if (L->q_norm) batchq_rmsnorm_row(qh, L->q_norm, qh, D, s->eps);
                    batchq_rotary_head(qh, c, sn, D);
                    for (int i = 0; i < D; i++) dst[i] = qh[i] * L->q_scale;
                }
                for (int kh = 0; kh < KVH; kh++) {
                    float *kr = row + q_size + (size_t)kh * D, *vr = row + q_size + kv_size + (size_t)kh * D;
                    if (L->k_norm) batchq_rmsnorm_row(kr, L->k_norm, kr, D, s->eps);
                    batchq_rotary_head(kr, c, sn, D);
                    write_cache(L->k_cache, s, kh, slots[m], kr, L->k_scale);
                    write_cache(L->v_cache, s, kh, slots[m], vr, L->v_scale);
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < M * KVH; i++) {
                batchq_paged_decode_task(qs, L->k_cache, L->v_cache, att, block_tables, context_lens, M, H, KVH, D,
                                         s->block_size, s->num_blocks, width, max_len, s->kv_elem, L->window,
                                         L->softcap, i, scores);
                if (L->v_scale != 1.0f) { /* this task's G heads of output, times v_scale */
                    float *o = att + ((size_t)(i / KVH) * H + (size_t)(i % KVH) * (H / KVH)) * D;
                    for (int j = 0; j < (H / KVH) * D; j++) o[j] *= L->v_scale;
                }
            }
            /* xn is free: the QKV linear read it before the last barrier */
            residual_out(att, &L->o, q_size, L->post_attn, h, xn, M, hid, s->eps, t, nt, tuning);
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) batchq_rmsnorm_row(h + (size_t)m * hid, L->ln2, xn + (size_t)m * hid, hid, s->eps);
            batchq_linear_part_w(xn, &L->gate_up, gu, M, hid, 2 * I, t, nt, 0, tuning);
#pragma omp barrier
            {
                /* every thread an equal share of the M * I products */
                const long n = (long)M * I, a = n * t / nt, b = n * (t + 1) / nt;
                for (long r = a; r < b;) {
                    const long m = r / I, i0 = r % I, len = (b - r < I - i0) ? b - r : I - i0;
                    const float *g = gu + (size_t)m * 2 * I + i0, *u = g + I;
                    if (L->act == ACT_SILU) silu_mul(g, u, act + (size_t)m * I + i0, len);
                    else gelu_mul(g, u, act + (size_t)m * I + i0, len, L->act == ACT_GELU_TANH);
                    r += len;
                }
            }
#pragma omp barrier
            /* xn is free: the gate/up linear read it before the activation's barrier */
            residual_out(act, &L->down, I, L->post_ff, h, xn, M, hid, s->eps, t, nt, tuning);
        }
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) batchq_rmsnorm_row(h + (size_t)m * hid, s->final_norm, out + (size_t)m * hid, hid, s->eps);
    }
    return 0;
}
