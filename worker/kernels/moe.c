/* A mixture-of-experts MLP's experts for the CPU: y[t] = sum over token t's top-k picks e of
   w[t, e] * down_e(act(gate_up_e(x[t]))).

   Built by worker/kernels/native_build.py with linear.c (whose batchq_linear_part_w runs every product),
   bound by native_moe.py.

   Grouped by expert: the step's (token, pick) pairs are sorted by expert (a counting sort, stable), the
   rows of each expert gathered into one block, and each expert's gate_up and down weights streamed once over
   all of its rows, as one linear layer of that many rows, its panels split among the threads. An expert no
   token picked is not read at all, so a step reads the weights of its active experts once, whatever the
   number of rows.

   x: [T, H] float32; ids: [T, topk] int64 expert indices; weights: [T, topk] float32 (the router's);
   gate_up: [E] experts of linear.c's packed [ceil(2I / PANEL), H, PANEL] (gate outputs 0..I-1, up I..2I-1);
   down: [E] of [ceil(H / PANEL), I, PANEL]; elem F32 or BF16 (linear.h); gate_up_bias [E, 2I] and
   down_bias [E, H] float32 or NULL. act 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU, gate clamped above
   at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate). y: [T, H] float32.
   Each token's picks are added in increasing expert order, starting from zero, as Hugging Face's loop over
   experts adds them. tuning: how linear.c streams the weights (linear.h). Returns nonzero for an expert
   index out of range, an unreadable weight or no memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"

#define PANEL 32 /* linear.c's */

#ifdef _OPENMP
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
#define THREAD omp_get_thread_num()
#define THREADS omp_get_num_threads()
#else
#define THREAD 0
#define THREADS 1
#endif

static void activate(const float *gu, float *h, const int rows, const int I, const int act, const float alpha,
                     const float limit) {
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (size_t)r * 2 * I, *u = g + I;
        float *o = h + (size_t)r * I;
        if (act == 0) {
            for (int j = 0; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        } else {
            for (int j = 0; j < I; j++) {
                const float gj = fminf(g[j], limit), uj = fminf(fmaxf(u[j], -limit), limit);
                o[j] = (uj + 1.0f) * (gj / (1.0f + expf(-alpha * gj)));
            }
        }
    }
}

int batchq_moe(const float *x, int T, int H, int I, int E, int topk, const int64_t *ids, const float *weights,
               const void *gate_up, const void *down, const float *gate_up_bias, const float *down_bias,
               int elem, int act, float alpha, float limit, float *y, int threads, const LinearTuning *tuning) {
    if (T < 1 || H < 1 || I < 1 || E < 1 || topk < 1 || topk > 64 || (elem != F32 && elem != BF16)) return 1;
    const int S = T * topk; /* (token, pick) slots */
    const size_t esize = elem == F32 ? 4 : 2;
    const size_t gu_stride = (size_t)((2 * I + PANEL - 1) / PANEL) * H * PANEL * esize;
    const size_t down_stride = (size_t)((H + PANEL - 1) / PANEL) * I * PANEL * esize;
    int *start = calloc((size_t)E + 1, sizeof(int));
    int *order = malloc((size_t)S * sizeof(int)), *where = malloc((size_t)S * sizeof(int));
    float *xs = malloc((size_t)S * H * sizeof(float)), *gu = malloc((size_t)S * 2 * I * sizeof(float));
    float *h = malloc((size_t)S * I * sizeof(float)), *out = malloc((size_t)S * H * sizeof(float));
    int rc = !start || !order || !where || !xs || !gu || !h || !out;
    for (int s = 0; !rc && s < S; s++) {
        if (ids[s] < 0 || ids[s] >= E) rc = 1;
        else start[ids[s] + 1]++;
    }
    if (!rc) {
        for (int e = 0; e < E; e++) start[e + 1] += start[e];
        int *fill = malloc((size_t)E * sizeof(int));
        if (!fill) rc = 1;
        else {
            memcpy(fill, start, (size_t)E * sizeof(int));
            for (int s = 0; s < S; s++) { /* stable: an expert's rows in token order */
                const int at = fill[ids[s]]++;
                order[at] = s;
                where[s] = at;
            }
            free(fill);
        }
    }
    if (!rc) {
        const char *gu_w = gate_up, *down_w = down;
        const int nthreads = threads > 0 ? threads : 1;
#pragma omp parallel num_threads(nthreads) reduction(| : rc)
        {
            const int t = THREAD, nt = THREADS;
            for (int r = t; r < S; r += nt) memcpy(xs + (size_t)r * H, x + (size_t)(order[r] / topk) * H, H * 4);
#pragma omp barrier
            for (int e = 0; e < E; e++) {
                const int r0 = start[e], n = start[e + 1] - r0;
                if (!n) continue;
                const LinearWeight lw = {gu_w + e * gu_stride, NULL, NULL,
                                         gate_up_bias ? gate_up_bias + (size_t)e * 2 * I : NULL, elem, 0, F32};
                rc |= batchq_linear_part_w(xs + (size_t)r0 * H, &lw, gu + (size_t)r0 * 2 * I, n, H, 2 * I, t, nt, 0,
                                           tuning);
            }
#pragma omp barrier
            {
                const int r0 = (int)((long)S * t / nt), r1 = (int)((long)S * (t + 1) / nt);
                activate(gu + (size_t)r0 * 2 * I, h + (size_t)r0 * I, r1 - r0, I, act, alpha, limit);
            }
#pragma omp barrier
            for (int e = 0; e < E; e++) {
                const int r0 = start[e], n = start[e + 1] - r0;
                if (!n) continue;
                const LinearWeight lw = {down_w + e * down_stride, NULL, NULL,
                                         down_bias ? down_bias + (size_t)e * H : NULL, elem, 0, F32};
                rc |= batchq_linear_part_w(h + (size_t)r0 * I, &lw, out + (size_t)r0 * H, n, I, H, t, nt, 0, tuning);
            }
#pragma omp barrier
            for (int tok = t; tok < T; tok += nt) {
                int picks[64];
                const int k = topk;
                for (int j = 0; j < k; j++) { /* insertion sort by expert: Hugging Face's order of the adds */
                    int s = tok * topk + j, i = j;
                    while (i > 0 && ids[picks[i - 1]] > ids[s]) {
                        picks[i] = picks[i - 1];
                        i--;
                    }
                    picks[i] = s;
                }
                float *yt = y + (size_t)tok * H;
                memset(yt, 0, (size_t)H * sizeof(float));
                for (int j = 0; j < k; j++) {
                    const float w = weights[picks[j]];
                    const float *o = out + (size_t)where[picks[j]] * H;
                    for (int c = 0; c < H; c++) yt[c] += o[c] * w;
                }
            }
        }
    }
    free(start);
    free(order);
    free(where);
    free(xs);
    free(gu);
    free(h);
    free(out);
    return rc;
}
