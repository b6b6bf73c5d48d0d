/* Decode-sized steps (M <= KB_ROWS rows) of the linear layers: each panel a K block at a time, the block
   reread from L1 by every tile of x rows (the K-block tiles, kb_tile), with 8-float vectors for every weight
   type and with 16-float ones for the weights dequantised first (FP8, Q4, Q8); grouped weights at a few
   rows dequantised in registers as the tiles multiply (kbq_tile), a single row's in q_row.
   batchq_linear_part_w (linear.c) sends them here; linear_panel.h has the layout and the tiles' shapes. */
#include <string.h>

#include "linear_panel.h"

/* Decode-sized steps taking the K-block tiles (linear_part_kb) can also prefetch every line
   FAR_PREFETCH_BYTES ahead into L2 (prefetcht1), beside the near prefetch into L1: far, the tuning's
   far_prefetch. The near one alone has only as many lines in flight as L1 has miss buffers, and once a
   step has several rows of arithmetic per weight row the hardware prefetchers run less far ahead of it; on
   some CPUs the far hint then keeps the stream at the memory's rate, on others it only adds instructions
   or, where every hint fills L1, evicts the block in use. It changes when lines arrive, never a result.
   Only where every weight type's decode steps take those tiles (KB_DIRECT: 8-float vectors), so that a
   probe streaming float32 weights measures what it sets; elsewhere it compiles away. */
#ifndef FAR_PREFETCH_BYTES
#define FAR_PREFETCH_BYTES 32768
#endif
#define PREFETCH_NEAR_FAR(t0, far, p)                                                             \
    do {                                                                                          \
        PREFETCH(t0, p);                                                                          \
        if (KB_DIRECT && (far)) __builtin_prefetch((const char *)(p) + FAR_PREFETCH_BYTES, 0, 2); \
    } while (0)

/* The tiles of a decode-sized step go through each K block of weights they read as stored KB_SUB rows at
   a time, every tile and half-panel tile over those rows before the next ones, their partial sums carried
   over in memory (kb_tile): with 8-float vectors a block's 8 KB of float32 weights is reread by up to a
   dozen tile calls, and half of it at a time stays in L1 while the stream ahead is fetched. A block
   dequantised into the L1 buffer goes whole. So do the blocks of weights read as stored once a step has
   KB_WHOLE or more rows per byte of weight: there the FMAs (and widenings), not the stream, set the pace,
   and each piece's carry-over of a tile's partial sums is overhead. A piece's prefetches then run a whole
   piece ahead (a float32 block is 8 KB): PREFETCH_BYTES ahead they would land inside the block in use and
   fetch nothing new. The sums are the block's whatever the pieces. */
#ifndef KB_SUB
#define KB_SUB (VL == 8 ? 32 : KBLOCK)
#endif
#ifndef KB_WHOLE
#define KB_WHOLE 4
#endif

/* Rows kn of one K block of a tile: mr x rows (stride K) against kn rows of a panel's nv vectors starting
   at w (row stride PANEL elements). The block's partial sums (mr rows of PANEL floats at part) start from
   zero when `first` and from part's otherwise; at the `last` rows of the block they are added to tot (same
   layout), else kept in part for the block's next rows, so a block gone through in pieces sums as one.
   npf <= 2 kn lines from pf are prefetched on the way, with hint t0 and far ahead with far (the tuning's).
   Only the first mx <= mr rows are x's: the tile's rows past them repeat row 0's products and are neither
   read from part nor written (paced tiles, see linear_part_kb). */
#if VL == 8
/* kb_tile with 8-float vectors (mr <= 6, nv <= 4, mr * nv <= 12): the same sums, each accumulator a named
   variable. GCC 12 allocates an array of 12 accumulators beside 2 weights and a broadcast badly in 16
   registers: some live on the stack across the loop, a store and reload per k on their FMA chains. */
#define A_ROW(i) vf a##i##0 = {0}, a##i##1 = {0}, a##i##2 = {0}, a##i##3 = {0};
#define A_ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5)
#define A_COLS(OP, i) OP(i, 0) OP(i, 1) OP(i, 2) OP(i, 3)
#define A_LOAD(i, j) \
    if (mx > i && nv > j && !first) a##i##j = *(const vf *)(part + (size_t)i * PANEL + j * VL);
#define A_FMA(i, j) \
    if (nv > j) a##i##j += xs * w##j;
#define A_STORE(i, j)                                                          \
    if (mx > i && nv > j) {                                                    \
        float *t_ = (last ? tot : part) + (size_t)i * PANEL + j * VL;          \
        *(vf *)t_ = last ? *(const vf *)t_ + a##i##j : a##i##j;                \
    }
#define A_ROW_LOAD(i) A_COLS(A_LOAD, i)
#define A_ROW_STORE(i) A_COLS(A_STORE, i)
#define A_ROW_FMA(i)                                      \
    if (mr > i) {                                         \
        const float xs = x[(size_t)(mx > i ? i : 0) * K + k]; \
        A_COLS(A_FMA, i)                                  \
    }
#define KB_STEP                                                              \
    {                                                                        \
        const char *p = w + (size_t)k * stride;                              \
        const vf w0 = in_register(load_w(p, elem));                          \
        vf w1 = {0}, w2 = {0}, w3 = {0};                                     \
        if (nv > 1) w1 = in_register(load_w(p + VL * es, elem));             \
        if (nv > 2) w2 = in_register(load_w(p + 2 * VL * es, elem));         \
        if (nv > 3) w3 = in_register(load_w(p + 3 * VL * es, elem));         \
        A_ROWS(A_ROW_FMA)                                                    \
    }
static inline __attribute__((always_inline)) void kb_tile_named(
    const float *x, const char *w, const char *pf, const int npf, float *tot, float *part, const int K,
    const int kn, const int mr, const int mx, const int nv, const int elem, const int first, const int last,
    const int t0, const int far
) {
    const size_t stride = row_bytes(elem), es = stride / PANEL;
    A_ROWS(A_ROW)
    A_ROWS(A_ROW_LOAD)
    /* The rows that prefetch two lines, then one, then none, as three loops: a test of k against npf at
       every row cost the tile's loop issue slots it has few of beside 12 FMAs and 8 loads. */
    const int n2 = npf > kn ? npf - kn : 0, n1 = npf < kn ? npf : kn;
    int k = 0;
    for (; k < n2; k++) {
        PREFETCH_NEAR_FAR(t0, far, pf + (size_t)k * 64);
        PREFETCH_NEAR_FAR(t0, far, pf + (size_t)(k + kn) * 64);
        KB_STEP
    }
    for (; k < n1; k++) {
        PREFETCH_NEAR_FAR(t0, far, pf + (size_t)k * 64);
        KB_STEP
    }
    for (; k < kn; k++) KB_STEP
    A_ROWS(A_ROW_STORE)
}
#endif

#if VL == 8
/* Grouped weights (Q4, Q8) at a few rows a step, dequantised in registers as the tiles multiply. Through
   the L1 buffer (dequantize, then tiles reading it) every weight is stored and loaded again besides being
   widened, and at a few x rows that round trip costs more than the FMAs. Here each tile of half a panel
   widens its own half of every row, so the work repeats per tile of rows: it pays while one tile holds
   every row (Q_FUSED_ROWS; with two tiles the repeated widening costs more than the buffer's round trip).
   dq_vec is vector j of a panel row as linear_dequantize computes it: Q4 packs columns c and c + PANEL / 2
   in the low and high nibble of byte c. */
#ifndef Q_FUSED_ROWS
#define Q_FUSED_ROWS 5 /* one tile: 10 accumulators beside 2 weights, a broadcast and the group vectors */
#endif
static inline __attribute__((always_inline)) vf dq_vec(const uint8_t *row, const int j, const vf s, const vf o,
                                                       const int elem) {
    if (elem == Q4) {
        const vu32 b = widen_u8(row + (j % (PANEL_VECS / 2)) * VL);
        return s * u32_to_f32(j >= PANEL_VECS / 2 ? b >> 4 : b & 0xF) - o;
    }
    return s * load_w((const char *)row + j * VL, I8) - o;
}

/* mr rows of x (stride K, from the block's first row) against rows k0 .. k0 + kn - 1 of vectors j0, j0 + 1
   of panel `panel` of a Q4 or Q8 weight (its rows from wq), the block's sums added to tot: the tile and the
   order of kb_tile over the dequantised block. */
static inline __attribute__((always_inline)) void kbq_tile(const float *x, const uint8_t *wq, const int panel,
                                                           const LinearWeight *lw, float *tot, const int K,
                                                           const int k0, const int kn, const int mr,
                                                           const int j0, const int elem) {
    const int nv = NV, last = 1, mx = mr;
    const size_t rb = row_bytes(elem);
    float *const part = tot;
    A_ROWS(A_ROW)
    for (int k = 0; k < kn;) {
        const int end = group_end(lw, k0, k, kn);
        const char *gp = group_at(lw, K, panel, (k0 + k) / lw->group);
        const vf s0 = group_vec(lw, gp, j0), s1 = group_vec(lw, gp, j0 + 1);
        const vf o0 = group_vec(lw, gp, PANEL_VECS + j0), o1 = group_vec(lw, gp, PANEL_VECS + j0 + 1);
        for (; k < end; k++) {
            const uint8_t *row = wq + (size_t)k * rb;
            const vf w0 = in_register(dq_vec(row, j0, s0, o0, elem));
            const vf w1 = in_register(dq_vec(row, j0 + 1, s1, o1, elem)), w2 = {0}, w3 = {0};
            A_ROWS(A_ROW_FMA)
        }
    }
    A_ROWS(A_ROW_STORE)
}
#endif

static inline __attribute__((always_inline)) void kb_tile(
    const float *x, const char *w, const char *pf, const int npf, float *tot, float *part, const int K,
    const int kn, const int mr, const int mx, const int nv, const int elem, const int first, const int last,
    const int t0, const int far
) {
#if VL == 8
    if (mr <= 6 && nv <= 4 && mr * nv <= 12) {
        kb_tile_named(x, w, pf, npf, tot, part, K, kn, mr, mx, nv, elem, first, last, t0, far);
        return;
    }
#endif
    const size_t stride = row_bytes(elem), es = stride / PANEL;
    vf acc[MR][PANEL_VECS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++)
            acc[i][j] = first || i >= mx ? (vf){0} : *(const vf *)(part + (size_t)i * PANEL + j * VL);
    /* Each row's x, opaque to the compiler: a row past mx reads row 0, and where GCC could see two rows
       read the same x it shared their product and left it a multiply and an add, rounded twice, not the
       FMA every other path computes (tiles of 7-12 rows then answered their first and last rows
       differently from the prompt path). */
    const float *xr[MR];
    for (int i = 0; i < mr; i++) {
        xr[i] = x + (size_t)(i < mx ? i : 0) * K;
        __asm__("" : "+r"(xr[i]));
    }
    for (int k = 0; k < kn; k++) {
        const char *p = w + (size_t)k * stride;
        if (k < npf) PREFETCH_NEAR_FAR(t0, far, pf + (size_t)k * 64);
        if (k + kn < npf) PREFETCH_NEAR_FAR(t0, far, pf + (size_t)(k + kn) * 64); /* a float32 block in one call */
        vf wv[PANEL_VECS];
        for (int j = 0; j < nv; j++) wv[j] = in_register(load_w(p + (size_t)j * VL * es, elem));
        for (int i = 0; i < mr; i++) {
            const float xs = xr[i][k];
            for (int j = 0; j < nv; j++) acc[i][j] += xs * wv[j];
        }
    }
    for (int i = 0; i < mx; i++)
        for (int j = 0; j < nv; j++) {
            float *t = (last ? tot : part) + (size_t)i * PANEL + j * VL;
            *(vf *)t = last ? *(const vf *)t + acc[i][j] : acc[i][j];
        }
}

/* Constant mr, nv and elem per specialisation, so each keeps its accumulators in registers; the tuning's
   prefetches read once a call. */
#define KB_FN(mr, elem)                                                                                   \
    static __attribute__((noinline)) void kb_##mr##_##elem(const float *x, const char *w, const char *pf,  \
                                                           int npf, float *tot, float *part, int K, int kn, \
                                                           int mx, int first, int last,                     \
                                                           const LinearTuning *tn) {                        \
        kb_tile(x, w, pf, npf, tot, part, K, kn, (mr) < MR ? (mr) : MR, mx, NV, elem, first, last,         \
                tn->prefetch_t0, tn->far_prefetch);                                                         \
    }
#define KBS(elem)                                                                                       \
    KB_FN(1, elem) KB_FN(2, elem) KB_FN(3, elem) KB_FN(4, elem) KB_FN(5, elem) KB_FN(6, elem) KB_FN(7, elem) \
        KB_FN(8, elem) KB_FN(9, elem) KB_FN(10, elem) KB_FN(11, elem) KB_FN(12, elem)
KBS(0)
KBS(1)
KBS(2)
typedef void (*kb_fn)(const float *, const char *, const char *, int, float *, float *, int, int, int, int,
                      int, const LinearTuning *);
#define KROW(e) {kb_1_##e, kb_2_##e, kb_3_##e, kb_4_##e, kb_5_##e, kb_6_##e, kb_7_##e, kb_8_##e, kb_9_##e, \
                 kb_10_##e, kb_11_##e, kb_12_##e}
static const kb_fn KB_FNS[3][12] = {KROW(0), KROW(1), KROW(2)};
#ifdef WIDE_ROWS
#define KBW_FN(mr, elem)                                                                                  \
    static __attribute__((noinline)) void kbw_##mr##_##elem(const float *x, const char *w, const char *pf, \
                                                            int npf, float *tot, float *part, int K,       \
                                                            int kn, int mx, int first, int last,            \
                                                            const LinearTuning *tn) {                       \
        kb_tile(x, w, pf, npf, tot, part, K, kn, mr, mx, PANEL_VECS, elem, first, last, tn->prefetch_t0,  \
                tn->far_prefetch);                                                                        \
    }
#define KBWS(elem) KBW_FN(1, elem) KBW_FN(2, elem) KBW_FN(3, elem)
KBWS(0)
KBWS(1)
KBWS(2)
#define KWROW(e) {kbw_1_##e, kbw_2_##e, kbw_3_##e}
static const kb_fn KBW_FNS[3][3] = {KWROW(0), KWROW(1), KWROW(2)};
#endif

#if VL == 8
#define KBQ_FN(mr, h, elem)                                                                                 \
    static __attribute__((noinline)) void kbq_##mr##_##h##_##elem(const float *x, const uint8_t *wq,         \
                                                                  int panel, const LinearWeight *lw,         \
                                                                  float *tot, int K, int k0, int kn) {       \
        kbq_tile(x, wq, panel, lw, tot, K, k0, kn, mr, (h) * NV, elem);                                     \
    }
#define KBQS(elem)                                                                                          \
    KBQ_FN(1, 0, elem) KBQ_FN(2, 0, elem) KBQ_FN(3, 0, elem) KBQ_FN(4, 0, elem) KBQ_FN(5, 0, elem)          \
        KBQ_FN(1, 1, elem) KBQ_FN(2, 1, elem) KBQ_FN(3, 1, elem) KBQ_FN(4, 1, elem) KBQ_FN(5, 1, elem)
KBQS(4)
KBQS(5)
typedef void (*kbq_fn)(const float *, const uint8_t *, int, const LinearWeight *, float *, int, int, int);
#define KQROW(e)                                                                                  \
    {{kbq_1_0_##e, kbq_2_0_##e, kbq_3_0_##e, kbq_4_0_##e, kbq_5_0_##e},                            \
     {kbq_1_1_##e, kbq_2_1_##e, kbq_3_1_##e, kbq_4_1_##e, kbq_5_1_##e}}
static const kbq_fn KBQ_FNS[2][2][5] = {KQROW(4), KQROW(5)}; /* Q4, Q8; half; rows */
#if Q_FUSED_ROWS > 5 || NV != 2 || PANEL_VECS != 4
#error "KBQ_FNS holds one tile of 1 to 5 rows over half a panel of four vectors"
#endif
#endif

/* One x row against rows k0 .. k0 + kn - 1 of a Q4 or Q8 panel, the weights dequantised in registers (no
   trip through dq: at one row, the store and reload would cost as much as the product), the block's
   partial sums added to tot: what linear_dequantize and a tile would compute, in the same order. Static
   here, beside its one caller, so that it inlines into linear_part_kb's loop over the K blocks. */
static void q_row(const float *x, const LinearWeight *lw, const int K, const int panel, const int k0,
                  const int kn, float *tot) {
    const size_t rb = row_bytes(lw->elem);
    const uint8_t *w = (const uint8_t *)lw->w + ((size_t)panel * K + k0) * rb;
    vf acc[PANEL_VECS];
    for (int j = 0; j < PANEL_VECS; j++) acc[j] = (vf){0};
    for (int k = 0; k < kn;) {
        const int end = group_end(lw, k0, k, kn);
        const char *gp = group_at(lw, K, panel, (k0 + k) / lw->group);
        vf s[PANEL_VECS], o[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) {
            s[j] = group_vec(lw, gp, j);
            o[j] = group_vec(lw, gp, PANEL_VECS + j);
        }
        for (; k < end; k++) {
            const uint8_t *row = w + (size_t)k * rb;
            const float xs = x[k0 + k];
            if (lw->elem == Q4) {
                for (int j = 0; j < PANEL_VECS / 2; j++) {
                    const vu32 b = widen_u8(row + j * VL);
                    const int hi = j + PANEL_VECS / 2;
                    const vf lo_w = s[j] * u32_to_f32(b & 0xF) - o[j], hi_w = s[hi] * u32_to_f32(b >> 4) - o[hi];
                    acc[j] += xs * lo_w;
                    acc[hi] += xs * hi_w;
                }
            } else {
                for (int j = 0; j < PANEL_VECS; j++) {
                    const vf wv = s[j] * load_w((const char *)row + j * VL, I8) - o[j];
                    acc[j] += xs * wv;
                }
            }
        }
    }
    for (int j = 0; j < PANEL_VECS; j++) *(vf *)(tot + j * VL) += acc[j];
}

/* Decode-sized steps: a panel a KBLOCK of rows at a time. The block (8 KB in float32) comes from memory once
   and stays in L1 while every tile of x rows, and with 8-float vectors each half of the panel, uses it; each
   tile adds its partial sums over the block to the panel's totals, the sums the panel tiles would form, in
   their order. The tiles of a block share out the prefetches of the weights ahead of it, so memory streams
   evenly however many tiles reread it. Weights the tiles do not read as they multiply (FP8, Q4, Q8) are
   dequantised a block at a time into an L1 buffer first, once for all the tiles.

   Paced tiles (the tuning's pace_rows): steps of fewer rows, of weights read as stored in half-panel
   tiles, can run through one tile of pace_rows rows, the rows past x's repeating row 0's products, which
   are never stored. A tile of one to three rows has so little arithmetic per weight line that its loop
   runs far ahead of the lines arriving, and on some CPUs the stream then slows below that of a full
   tile's steps, whose FMAs pace the loop; the idle rows cost FMAs that memory-bound steps have to spare.
   Elsewhere the idle FMAs only cost, so it is the machine's choice. Each real row's sums are the same
   either way. */
void linear_part_kb(const float *x, const LinearWeight *lw, float *y, const int M, const int K, const int N,
                    const int p0, const int p1, const int accumulate, const LinearTuning *tn) {
    const int elem = lw->elem, direct = read_direct(elem);
    const size_t rb = row_bytes(elem), panel_bytes = (size_t)K * rb;
    /* rows a tile call takes of a block (a dequantised block is in L1 already: whole), and how far ahead
       of its piece a call prefetches: at least the piece, or it would prefetch lines of the piece itself */
    const int sub = !direct || M >= KB_WHOLE * (int)(rb / PANEL) ? KBLOCK : KB_SUB;
    const size_t ahead = (size_t)sub * rb > PREFETCH_BYTES ? (size_t)sub * rb : PREFETCH_BYTES;
    int mr_max = MR, tcols = TCOLS;
    const kb_fn *fns = KB_FNS[direct ? elem : F32];
#ifdef WIDE_ROWS
    if (M <= tn->wide_rows) mr_max = WIDE_MR, tcols = PANEL, fns = KBW_FNS[direct ? elem : F32];
#endif
    const int tiles = (M + mr_max - 1) / mr_max, halves = PANEL / tcols, calls = tiles * halves;
    /* the knobs a build lacks are constant 0 (in_force makes them so), and their code compiles away */
    const int pace = KB_DIRECT ? tn->pace_rows : 0, paced = direct && tcols == TCOLS && M < pace ? pace : 0;
    const int t0 = tn->prefetch_t0, far = KB_DIRECT && tn->far_prefetch;
    float tot[KB_ROWS * PANEL] __attribute__((aligned(64))), part[KB_ROWS * PANEL] __attribute__((aligned(64)));
    float dq[KBLOCK * PANEL] __attribute__((aligned(64)));
    for (int p = p0; p < p1; p++) {
        const char *wp = (const char *)lw->w + (size_t)p * panel_bytes;
        memset(tot, 0, sizeof(float) * (size_t)M * PANEL);
        for (int k0 = 0; k0 < K; k0 += KBLOCK) {
            const int kn = K - k0 < KBLOCK ? K - k0 : KBLOCK;
            const char *wk = wp + (size_t)k0 * rb, *src = wk;
            const int lines = (int)((kn * rb + 63) / 64);
            if (!direct) {
                for (int l = 0; l < lines; l++) PREFETCH_NEAR_FAR(t0, far, wk + PREFETCH_BYTES + (size_t)l * 64);
                if (M == 1 && elem != FP8) {
                    q_row(x, lw, K, p, k0, kn, tot);
                    continue;
                }
#if VL == 8
                if (M <= Q_FUSED_ROWS && elem != FP8) {
                    for (int h = 0; h < 2; h++)
                        KBQ_FNS[elem == Q8][h][M - 1](x + k0, (const uint8_t *)wk, p, lw, tot + h * TCOLS, K, k0, kn);
                    continue;
                }
#endif
                linear_dequantize(lw, K, p, k0, kn, dq);
                src = (const char *)dq;
            }
            const size_t hb = (size_t)tcols * (direct ? rb / PANEL : 4), sb = direct ? rb : PANEL * 4;
            for (int s0 = 0; s0 < kn; s0 += sub) {
                const int sn = kn - s0 < sub ? kn - s0 : sub, first = s0 == 0, last = s0 + sn == kn;
                const char *ws = wk + (size_t)s0 * rb, *ss = src + (size_t)s0 * sb;
                const int slines = direct ? (int)((sn * rb + 63) / 64) : 0;
                for (int i = 0, c = 0; i < tiles; i++) {
                    const int m0 = M * i / tiles, mr = M * (i + 1) / tiles - m0;
                    for (int h = 0; h < halves; h++, c++) {
                        const int l0 = slines * c / calls, l1 = slines * (c + 1) / calls;
                        const size_t at = (size_t)m0 * PANEL + h * tcols;
                        fns[(paced ? paced : mr) - 1](x + (size_t)m0 * K + k0 + s0, ss + h * hb,
                                                      ws + ahead + (size_t)l0 * 64, l1 - l0, tot + at,
                                                      part + at, K, sn, mr, first, last, tn);
                    }
                }
            }
        }
        linear_store_panel(tot, lw, y, M, N, p * PANEL, accumulate);
    }
}
