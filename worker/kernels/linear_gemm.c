/* Prompt-sized steps (M > KB_ROWS), GEMM-blocked (GotoBLAS's loop order), with 8-float vectors: there they
   run faster than the panel tiles (linear_panels.c), which read a whole K of a half-panel per tile of rows,
   K x 64 bytes, which leaves L1 past K = 512 (and, with the x rows it meets, L2 past a few thousand): at a
   7B model's K of 4,096-14,336 their rate fell well below the FMA peak. Here K goes in chunks of GEMM_KC rows, so each
   chunk of a half-panel (16 KB of float32) stays in L1 while every tile of a chunk of GEMM_MC x rows rereads
   it, and that chunk of x stays in L2 while every panel of a group meets it. x is read where it lies (a
   tile's GMR row pointers, one broadcast each per k: GMR sequential streams), not packed first: packing
   buys one stream per tile, which the tiles do not need, and here each thread would repack all of x for
   every group of its panels (benchmarks/linear_ab.c's prompt steps measure the difference). Every output
   sums the same products in the same order as the other paths (KBLOCK blocks of FMAs, each added to a
   total that starts at zero), and goes out through linear_store_panel as the decode-sized path's do, so a
   row's answer does not depend on the rows beside it. No knob of the tuning applies here: the next panel's
   chunk is prefetched into L2 (prefetcht1) with a fixed hint.

   batchq_linear_part_w (linear.c) sends them here; linear_panel.h has the layout and the tiles' shapes. */
#include <stdlib.h>
#include <string.h>

#include "linear_panel.h"

#if GEMM_BLOCKED
#ifndef GEMM_MC
#define GEMM_MC 96 /* x rows a chunk: 16 tiles of 6 */
#endif
#ifndef GEMM_KC
#define GEMM_KC 256 /* K rows a chunk; a multiple of KBLOCK, so the block sums are the same */
#endif
#ifndef GEMM_NC
#define GEMM_NC 16 /* panels a group: the group's totals, 16 tiles x 16 panels x 768 bytes, 196 KB */
#endif
#define GMR MR
#if GEMM_KC % KBLOCK
#error "GEMM_KC must be a multiple of KBLOCK"
#endif

/* kn rows (KBLOCK blocks, the last possibly short) of GMR x rows (x + i * ldx, columns 0 .. kn - 1; rows past
   mr repeat row 0: one tile shape for every tile, their products never stored) against TCOLS columns of
   weights at w (row stride `stride`): each block's sums added to tot (GMR rows of PANEL floats). npf lines
   from pf are prefetched into L2 on the way: the block the next call of the group reads. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, const size_t ldx, const int mr,
                                                            const char *w, const size_t stride, const int kn,
                                                            const int elem, float *tot, const char *pf,
                                                            const int npf) {
    const size_t es = stride / PANEL;
    const float *xr[GMR];
    for (int i = 0; i < GMR; i++) xr[i] = x + (size_t)(i < mr ? i : 0) * ldx;
    int l = 0;
    for (int b0 = 0; b0 < kn; b0 += KBLOCK) {
        const int b1 = b0 + KBLOCK < kn ? b0 + KBLOCK : kn;
        vf acc[GMR][NV];
        for (int i = 0; i < GMR; i++)
            for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};
        for (int k = b0; k < b1; k++) {
            const char *p = w + (size_t)k * stride;
            if (l < npf) __builtin_prefetch(pf + (size_t)l++ * 64, 0, 2);
            vf wv[NV];
            for (int j = 0; j < NV; j++) wv[j] = in_register(load_w(p + (size_t)j * VL * es, elem));
            for (int i = 0; i < GMR; i++) {
                const float xs = xr[i][k];
                for (int j = 0; j < NV; j++) acc[i][j] += xs * wv[j];
            }
        }
        for (int i = 0; i < GMR; i++)
            for (int j = 0; j < NV; j++) *(vf *)(tot + (size_t)i * PANEL + j * VL) += acc[i][j];
    }
}
#define GEMM_FN(elem)                                                                                       \
    static __attribute__((noinline)) void gemm_##elem(const float *x, size_t ldx, int mr, const char *w,   \
                                                      size_t stride, int kn, float *tot, const char *pf,   \
                                                      int npf) {                                           \
        gemm_tile(x, ldx, mr, w, stride, kn, elem, tot, pf, npf);                                           \
    }
GEMM_FN(0)
GEMM_FN(1)
GEMM_FN(2)
typedef void (*gemm_fn)(const float *, size_t, int, const char *, size_t, int, float *, const char *, int);
static const gemm_fn GEMM_FNS[3] = {gemm_0, gemm_1, gemm_2}; /* by element type: F32, BF16, I8 */

/* A thread's scratch for the blocked path, kept for its next call (a call's fresh allocation of these
   hundreds of KB faulted its pages in again every time). */
static __thread float *gemm_scratch;
static __thread size_t gemm_scratch_floats;

static float *scratch(const size_t floats) {
    if (floats > gemm_scratch_floats) {
        free(gemm_scratch);
        gemm_scratch = aligned_alloc(64, floats * sizeof(float));
        gemm_scratch_floats = gemm_scratch ? floats : 0;
    }
    return gemm_scratch;
}

int linear_part_gemm(const float *x, const LinearWeight *lw, float *y, const int M, const int K, const int N,
                     const int p0, const int p1, const int accumulate) {
    const int direct = read_direct(lw->elem), elem = direct ? lw->elem : F32;
    const size_t rb = row_bytes(lw->elem), panel_bytes = (size_t)K * rb;
    const int halves = PANEL / TCOLS;
    const size_t tiles_max = (GEMM_MC + GMR - 1) / GMR, kc_max = K < GEMM_KC ? (size_t)K : GEMM_KC;
    const size_t tot_floats = tiles_max * GEMM_NC * GMR * PANEL;
    float *const tot = scratch(tot_floats + (direct ? 0 : kc_max * PANEL));
    if (!tot) return 1;
    float *const dq = tot + tot_floats;
    const gemm_fn fn = GEMM_FNS[elem];
    for (int g0 = p0; g0 < p1; g0 += GEMM_NC) {
        const int g1 = p1 - g0 < GEMM_NC ? p1 : g0 + GEMM_NC, np = g1 - g0;
        for (int m0 = 0; m0 < M; m0 += GEMM_MC) {
            const int mc = M - m0 < GEMM_MC ? M - m0 : GEMM_MC, tiles = (mc + GMR - 1) / GMR;
            memset(tot, 0, sizeof(float) * (size_t)tiles * np * GMR * PANEL);
            for (int k0 = 0; k0 < K; k0 += GEMM_KC) {
                const int kn = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
                for (int p = g0; p < g1; p++) {
                    const char *wk = (const char *)lw->w + (size_t)p * panel_bytes + (size_t)k0 * rb, *src = wk;
                    size_t stride = rb;
                    if (!direct) {
                        linear_dequantize(lw, K, p, k0, kn, dq);
                        src = (const char *)dq, stride = PANEL * 4;
                    }
                    /* the next panel's chunk, fetched into L2 while this one's tiles run */
                    const int lines = p + 1 < g1 ? (int)((kn * rb + 63) / 64) : 0, calls = tiles * halves;
                    for (int h = 0, c = 0; h < halves; h++)
                        for (int t = 0; t < tiles; t++, c++) {
                            const int l0 = lines * c / calls, l1 = lines * (c + 1) / calls;
                            const int r0 = t * GMR, mr = mc - r0 < GMR ? mc - r0 : GMR;
                            fn(x + (size_t)(m0 + r0) * K + k0, (size_t)K, mr,
                               src + (size_t)h * TCOLS * (stride / PANEL), stride, kn,
                               tot + ((size_t)t * np + (p - g0)) * GMR * PANEL + h * TCOLS,
                               wk + panel_bytes + (size_t)l0 * 64, l1 - l0);
                        }
                }
            }
            for (int t = 0; t < tiles; t++) {
                const int r0 = t * GMR, mr = mc - r0 < GMR ? mc - r0 : GMR;
                for (int p = g0; p < g1; p++)
                    linear_store_panel(tot + ((size_t)t * np + (p - g0)) * GMR * PANEL, lw,
                                       y + (size_t)(m0 + r0) * N, mr, N, p * PANEL, accumulate);
            }
        }
    }
    return 0;
}
#endif
