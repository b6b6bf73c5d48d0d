/* The panel tiles: a panel at a time, streamed once, every tile of x rows over it (up to MR rows, with
   16-float vectors a whole panel wide): with 16-float vectors every step of the weights read as stored
   and every prompt-sized one (M > KB_ROWS); with 8-float vectors, which take the GEMM-blocked path for
   prompt-sized steps (linear_gemm.c), only where a build asks for them (-DGEMM_BLOCKED=0, tests).
   batchq_linear_part_w (linear.c) sends them here; linear_panel.h has the layout and the tiles' shapes. */
#include "linear_panel.h"

#if !GEMM_BLOCKED
/* One tile: mr x rows (stride K) against the cols <= TCOLS columns of a panel starting at w (panel row
   stride PANEL elements); writes (accumulate: adds to) y rows (stride N) from its first column. scale,
   bias: the tile's first column's, or NULL. pf: what to prefetch, row k at pf + k * the row stride, with
   hint t0 (the tuning's prefetch_t0). full: whether the panel has all PANEL columns; a partial one goes out
   a column at a time, as linear_store_panel writes it (vector and scalar code may contract the scale and
   bias differently), so that a row's answer is the same whichever path computed it. */
static inline __attribute__((always_inline)) void tile(
    const float *x, const char *w, const char *pf, float *y, const int K, const int N, const int mr,
    const int nv, const int cols, const int full, const int elem, const float *scale, const float *bias,
    const int accumulate, const int t0
) {
    const size_t stride = row_bytes(elem), es = stride / PANEL;
    /* The running totals, touched once a KBLOCK, live in memory: left to the register allocator, a 7-row
       tile's 14 accumulators, 14 totals, 2 weight vectors and a broadcast took 31 of AVX-512's 32
       registers, GCC kept the totals and spilled the weights, and every FMA read its weight from the
       stack, where tiles of 6 or 8 rows keep theirs in registers. */
    vf acc[MR][PANEL_VECS];
    volatile vf total[MR][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) total[i][j] = (vf){0};
    for (int k0 = 0; k0 < K; k0 += KBLOCK) {
        const int k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nv; j++) acc[i][j] = (vf){0};
        for (int k = k0; k < k1; k++) {
            const char *p = w + (size_t)k * stride;
            PREFETCH(t0, pf + (size_t)k * stride);
            if (stride > 64) PREFETCH(t0, pf + (size_t)k * stride + 64); /* float32: 2 lines a row */
            vf wv[PANEL_VECS];
            for (int j = 0; j < nv; j++) wv[j] = in_register(load_w(p + (size_t)j * VL * es, elem));
            for (int i = 0; i < mr; i++) {
                /* A scalar times a vector: the compiler broadcasts x[m, k] straight from memory into the
                   FMA's operand. (A vector built as `(vf){0} + x` costs a scalar add and a register
                   broadcast per row and k: -0.0 + 0.0 is not -0.0, so the add cannot be dropped.) */
                const float xs = x[(size_t)i * K + k];
                for (int j = 0; j < nv; j++) acc[i][j] += xs * wv[j];
            }
        }
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nv; j++) total[i][j] += acc[i][j];
    }
    for (int i = 0; i < mr; i++) {
        float *out = y + (size_t)i * N;
        for (int j = 0; j < nv; j++) {
            const int c0 = j * VL;
            vf v = total[i][j];
            if (full && cols >= c0 + VL) {
                if (scale) v *= *(const vf *)(scale + c0);
                if (bias) v += *(const vf *)(bias + c0);
                if (accumulate) v += *(const vf *)(out + c0); /* a residual, added as torch's `h + y` */
                *(vf *)(out + c0) = v;
            } else {
                for (int l = 0; l < cols - c0; l++) {
                    float s = v[l];
                    if (scale) s *= scale[c0 + l];
                    if (bias) s += bias[c0 + l];
                    out[c0 + l] = accumulate ? out[c0 + l] + s : s;
                }
            }
        }
    }
}

/* Constant mr and elem per specialisation, so each keeps its accumulators in registers. */
#define TILE_FN(mr, elem)                                                                                \
    static __attribute__((noinline)) void tile_##mr##_##elem(                                           \
        const float *x, const char *w, const char *pf, float *y, int K, int N, int cols, int full,        \
        const float *s, const float *b, int acc, int t0                                                  \
    ) {                                                                                                  \
        tile(x, w, pf, y, K, N, (mr) < MR ? (mr) : MR, NV, cols, full, elem, s, b, acc, t0);             \
    }
#define TILES(elem)                                                                                    \
    TILE_FN(1, elem) TILE_FN(2, elem) TILE_FN(3, elem) TILE_FN(4, elem) TILE_FN(5, elem) TILE_FN(6, elem) \
        TILE_FN(7, elem) TILE_FN(8, elem) TILE_FN(9, elem) TILE_FN(10, elem) TILE_FN(11, elem) TILE_FN(12, elem)
TILES(0)
TILES(1)
TILES(2)

typedef void (*tile_fn)(
    const float *, const char *, const char *, float *, int, int, int, int, const float *, const float *, int, int
);
/* By element type (those tile() reads itself: F32, BF16, I8) and rows (1 .. 12, the largest MR). */
#define ROW(e) {tile_1_##e, tile_2_##e, tile_3_##e, tile_4_##e, tile_5_##e, tile_6_##e, tile_7_##e, tile_8_##e, \
                tile_9_##e, tile_10_##e, tile_11_##e, tile_12_##e}
static const tile_fn TILE_FNS[3][12] = {ROW(0), ROW(1), ROW(2)};
#ifdef WIDE_ROWS
#define WIDE_FN(mr, elem)                                                                                \
    static __attribute__((noinline)) void wide_##mr##_##elem(                                           \
        const float *x, const char *w, const char *pf, float *y, int K, int N, int cols, int full,        \
        const float *s, const float *b, int acc, int t0                                                  \
    ) {                                                                                                  \
        tile(x, w, pf, y, K, N, mr, PANEL_VECS, cols, full, elem, s, b, acc, t0);                        \
    }
#define WIDES(elem) WIDE_FN(1, elem) WIDE_FN(2, elem) WIDE_FN(3, elem)
WIDES(0)
WIDES(1)
WIDES(2)
#if WIDE_MR > 3
#error "WIDE_MR > 3: WIDE_FNS has tiles of 1 to 3 rows"
#endif
#define WROW(e) {wide_1_##e, wide_2_##e, wide_3_##e}
static const tile_fn WIDE_FNS[3][3] = {WROW(0), WROW(1), WROW(2)};
#endif

/* Rows a tile takes at most in prompt-sized steps (M > KB_ROWS). With 16-float vectors, tiles of MR = 12
   rows serve decode steps best (the fewest rereads of panels streamed from memory), but prompt steps, which
   reread every panel from L2 anyway, run faster in 8-row ones (benchmarks/linear_ab.c at prompt sizes). */
#ifndef PROMPT_MR
#define PROMPT_MR (VL == 16 ? 8 : MR)
#endif
/* Each panel streamed once, x rows in tiles that reread it from L2. A weight the tiles do not read as they
   multiply is dequantised a panel at a time into `dq` first (K x PANEL floats). */
void linear_part_tiles(const float *x, const LinearWeight *lw, float *y, const int M, const int K, const int N,
                       const int p0, const int p1, const int accumulate, float *dq, const LinearTuning *tn) {
    const int direct = read_direct(lw->elem), elem = direct ? lw->elem : F32, t0 = tn->prefetch_t0;
    const size_t panel_bytes = (size_t)K * row_bytes(lw->elem);
    int mr_max = M > KB_ROWS ? PROMPT_MR : MR, tcols = TCOLS;
    const tile_fn *fns = TILE_FNS[elem];
#ifdef WIDE_ROWS
    if (M <= tn->wide_rows) mr_max = WIDE_MR, tcols = PANEL, fns = WIDE_FNS[elem];
#endif
    const int tiles = (M + mr_max - 1) / mr_max; /* of balanced sizes: 16 rows are 2 x 8, not 12 + 4 */
    for (int p = p0; p < p1; p++) {
        const char *wp = (const char *)lw->w + (size_t)p * panel_bytes;
        const int full = N - p * PANEL >= PANEL;
        if (!direct) {
            for (int k0 = 0; k0 < K; k0 += KBLOCK)
                linear_dequantize(lw, K, p, k0, K - k0 < KBLOCK ? K - k0 : KBLOCK, dq + (size_t)k0 * PANEL);
            wp = (const char *)dq;
        }
        const size_t stride = direct ? row_bytes(elem) : PANEL * 4, next = direct ? panel_bytes : 0;
        for (int h = 0; h < PANEL / tcols; h++) {
            const int n0 = p * PANEL + h * tcols, cols = N - n0 < tcols ? N - n0 : tcols;
            if (cols <= 0) break;
            const char *wt = wp + (size_t)h * tcols * (stride / PANEL);
            for (int i = 0; i < tiles; i++) {
                const int m0 = M * i / tiles, mr = M * (i + 1) / tiles - m0;
                /* The first tile streams the panel from memory, prefetching ahead in it; the second reads it
                   from L2 and prefetches the next panel meanwhile, so memory never waits for the tiles that
                   reuse a panel; later tiles touch their own rows. */
                const char *pf = i == 0 ? wt + PREFETCH_BYTES : i == 1 && p + 1 < p1 && next ? wt + next : wt;
                fns[mr - 1](x + (size_t)m0 * K, wt, pf, y + (size_t)m0 * N + n0, K, N, cols, full,
                            lw->scale ? lw->scale + n0 : NULL, lw->bias ? lw->bias + n0 : NULL, accumulate, t0);
            }
        }
    }
}
#endif
