/* y = x W^T (+ bias) for the CPU: the linear layers of every step, decode-sized or prompt-sized.

   Built by worker/kernels/native_build.py (cc -O3 -march=native -fopenmp), bound by native_linear.py.

   x: [M, K] float32 (rows contiguous); bias: [N] float32 or NULL; y: [M, N] float32. W, the [N, K]
   weight of nn.Linear, is stored packed in panels of PANEL output columns (native_linear.pack): panel p
   holds columns p*PANEL .. p*PANEL+PANEL-1 as K rows of PANEL contiguous elements, [ceil(N/PANEL), K,
   PANEL], the last panel zero-padded; float32, bfloat16, or int8 with a float32 scale per output (wscale).

   Why not torch: at the row counts of decode steps (1-64) MKL's sgemm runs far below the machine's memory
   bandwidth, worse on AMD than on Intel (issue #21), and at prompt sizes this kernel also outruns MKL's
   float32 rate on AMD (`python benchmarks/kernel_bench.py --linear` measures both against the bounds).

   How (the register-tiled outer product of GEMM kernels): a tile is MR rows of x against NV vectors of
   VL output columns. For each k it loads the NV weight vectors of panel row k (widening bfloat16 and
   int8 to float32) and, for each x row, multiplies them by x[m, k] broadcast (AVX-512 folds the
   broadcast into the FMA), so MR x NV accumulators stay in registers, need no horizontal sums, and hold
   finished outputs at the end. A panel is one contiguous stream: threads (torch's OpenMP pool) take
   contiguous ranges of panels, and each streams its weights from memory once per call; further tiles of
   x rows read the panel again from L2. float32 accumulation for every weight type (int8 times its
   column's scale after the sum). The layout and PANEL are the same on every instruction set (only VL, MR
   and the number of tiles per panel differ), so a packed weight is valid wherever it is loaded. Decode-sized
   steps go through each panel a K block at a time (linear_part_kb); prompt-sized ones, with 8-float
   vectors, through chunks of rows, K and panels sized for L1 and L2 (linear_part_gemm). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 32 /* output columns per panel: native_linear.py's PANEL */
#ifndef NV
#define NV 2 /* weight vectors per tile and k: a tile's NV * VL columns */
#endif

#ifdef __AVX512F__
#define VL 16 /* floats per vector register */
#ifndef MR
#define MR 12 /* x rows per tile at most: 24 accumulators + 2 weights of 32 registers (broadcasts fold into FMAs) */
#endif
#else
#define VL 8
#ifndef MR
#define MR 6 /* 12 accumulators + 2 weights + 1 broadcast <= 16 registers */
#endif
#endif
#if MR > 12
#error "MR > 12: TILE_FNS has tiles of 1 to 12 rows"
#endif
#define TCOLS (NV * VL) /* a tile's columns: the whole panel with AVX-512, half of it with 8-float vectors */
#define PANEL_VECS (PANEL / VL)
/* With 8-float vectors a tile of MR rows covers half a panel, so a panel is streamed in two passes, each
   reading one of the two cache lines of every panel row, with few independent FMA chains per pass when M
   is small. Where one tile holds every row (M <= wide_rows), a tile over the whole panel can stream it once
   with PANEL_VECS chains per row: WIDE_MR rows x PANEL_VECS vectors = 12 accumulators of the 16
   registers. Which streams faster at 1-3 rows differs between CPUs, either way (benchmarks/RESULTS.md has
   the runs), so it is the machine's choice,
   measured at load and set by batchq_linear_set_wide_rows: 0 (halves) until then. Every output sums the
   same products in the same order either way, so the choice never changes a result. With more rows the
   whole-panel tiles would each reread the panel, and the MR x NV tiles, which need fewer broadcasts per
   FMA, do better. */
#if TCOLS < PANEL
#ifndef WIDE_MR
#define WIDE_MR 3
#endif
#define WIDE_ROWS WIDE_MR /* the most rows whole-panel tiles can take */
static int wide_rows = 0;
#endif

/* Sets the rows up to which decode-sized steps take whole-panel tiles (at most WIDE_ROWS; a negative
   `rows` changes nothing) and returns the setting now in force: always 0 where one tile spans the whole
   panel anyway (AVX-512). Set it while no linear call runs (a plain global, read by every call's threads). */
int batchq_linear_set_wide_rows(int rows) {
#ifdef WIDE_ROWS
    if (rows >= 0) wide_rows = rows > WIDE_ROWS ? WIDE_ROWS : rows;
    return wide_rows;
#else
    (void)rows;
    return 0;
#endif
}

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vu16 __attribute__((vector_size(VL * 2), aligned(2)));
typedef int8_t vi8 __attribute__((vector_size(VL), aligned(1)));
typedef uint8_t vu8 __attribute__((vector_size(VL), aligned(1)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
typedef int32_t vi32 __attribute__((vector_size(VL * 4)));

#include "cpu_math.h"
#include "linear.h"

/* Bytes of one panel row (PANEL weights) by element type. Q4 packs two weights a byte: byte j of a row holds
   column j in its low nibble and column j + PANEL / 2 in its high one, so one widened load gives both halves
   of the panel row. */
static inline size_t row_bytes(const int elem) {
    return elem == F32 ? PANEL * 4 : elem == BF16 ? PANEL * 2 : elem == Q4 ? PANEL / 2 : PANEL;
}
/* A panel is prefetched this far ahead of its loads: the hardware prefetchers alone keep too few lines in
   flight once a tile has several x rows of work per weight. It covers DRAM latency at one core's share of
   the bandwidth. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
/* The prefetches' hint: non-temporal (prefetchnta: the weights, streamed once a step, evict little else)
   or into every level (prefetcht0). Which streams faster is the machine's: on some CPUs the non-temporal
   prefetches leave the weights streaming far slower, on others the hint makes no difference beyond the
   noise (benchmarks/RESULTS.md has the runs). So it is measured at load and set by
   batchq_linear_set_prefetch_t0 (non-temporal until then). The branch is taken the same way all along,
   and the hint changes when lines arrive, never a result. */
static int prefetch_t0 = 0;
#define PREFETCH(p)                                         \
    do {                                                    \
        if (prefetch_t0) __builtin_prefetch((p), 0, 3);     \
        else __builtin_prefetch((p), 0, 0);                 \
    } while (0)

/* Sets the prefetch hint (1: prefetcht0, 0: prefetchnta; a negative `t0` changes nothing) and returns the
   one in force. Set it while no linear call runs. */
int batchq_linear_set_prefetch_t0(int t0) {
    if (t0 >= 0) prefetch_t0 = t0 != 0;
    return prefetch_t0;
}
/* Each output sums KBLOCK products in registers at a time, then adds that partial sum to its total: one
   sequential float32 sum over all of K (an MLP's intermediate size of terms) errs several times more than
   MKL's blocked sums. A KBLOCK of a float32 panel (8 KB) also fits L1 beside the x rows it meets. */
#ifndef KBLOCK
#define KBLOCK 64
#endif
/* Decode-sized steps (M <= KB_ROWS) of the weights linear.c dequantises, and with 8-float vectors of every
   weight (KB_DIRECT), go through the panel a KBLOCK at a time (linear_part_kb): a tile there covers half a
   panel, so the two halves and every tile of rows then reread the block from L1 rather than the panel from
   L2. With 16-float vectors one tile holds a whole panel and up to MR rows, and the panel-at-a-time tiles
   do better. */
#ifndef KB_ROWS
#define KB_ROWS 64
#endif
#ifndef KB_DIRECT
#define KB_DIRECT (VL == 8)
#endif
/* Decode-sized steps taking the K-block tiles (linear_part_kb) can also prefetch every line
   FAR_PREFETCH_BYTES ahead into L2 (prefetcht1), beside the near prefetch into L1. The near one alone has
   only as many lines in flight as L1 has miss buffers, and once a step has several rows of arithmetic per
   weight row the hardware prefetchers run less far ahead of it; on some CPUs the far hint then keeps the
   stream at the memory's rate, on others it only adds instructions or, where every hint fills L1, evicts
   the block in use. So it is measured at load and set by batchq_linear_set_far_prefetch (off until then);
   it changes when lines arrive, never a result. Only where every weight type's decode steps take those
   tiles (KB_DIRECT: 8-float vectors), so that a probe streaming float32 weights measures what it sets. */
#ifndef FAR_PREFETCH_BYTES
#define FAR_PREFETCH_BYTES 32768
#endif
static int far_prefetch = 0;
#define PREFETCH_NEAR_FAR(p)                                                                  \
    do {                                                                                      \
        PREFETCH(p);                                                                          \
        if (far_prefetch) __builtin_prefetch((const char *)(p) + FAR_PREFETCH_BYTES, 0, 2);  \
    } while (0)

/* Sets the far prefetch (1: on, 0: off; a negative `on` changes nothing) and returns the setting in force:
   always 0 where decode steps of float32 weights do not take the K-block tiles. Set it while no linear
   call runs. */
int batchq_linear_set_far_prefetch(int on) {
#if KB_DIRECT
    if (on >= 0) far_prefetch = on != 0;
#else
    (void)on;
#endif
    return far_prefetch;
}

/* Decode-sized steps of fewer than pace_rows rows (of weights read as stored, in half-panel K-block tiles)
   can run through tiles of pace_rows rows, the rows past x's repeating row 0's products, which are never
   stored. A tile of one to three rows has so little arithmetic per weight line that its loop runs far ahead
   of the lines arriving, and on some CPUs the stream then slows below that of six-row steps, whose FMAs
   pace the loop (benchmarks/RESULTS.md); the idle rows cost FMAs that memory-bound steps have
   to spare. Elsewhere the idle FMAs only cost, so it is measured at load and set by
   batchq_linear_set_pace_rows (0, off, until then). Each real row's sums are the same either way. */
static int pace_rows = 0;

/* Sets pace_rows (0 or 2 .. MR; a negative `rows` changes nothing) and returns the setting in force: always 0
   where decode steps of float32 weights do not take the K-block tiles. Set it while no linear call runs. */
int batchq_linear_set_pace_rows(int rows) {
#if KB_DIRECT
    if (rows >= 0) pace_rows = rows < 2 ? 0 : rows > MR ? MR : rows;
#else
    (void)rows;
#endif
    return pace_rows;
}

/* Prompt-sized steps (M > KB_ROWS) with 8-float vectors take the GEMM-blocked path (linear_part_gemm); with
   16-float ones the panel tiles (linear_part_tiles), which also run AVX-512's decode-sized steps. */
#ifndef GEMM_BLOCKED
#define GEMM_BLOCKED (VL == 8)
#endif
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

/* VL weights widened to float32. The widenings are intrinsics on x86: GCC 12 turns the generic
   __builtin_convertvector of int8 lanes into scalar inserts (int8 weights then ran slower than float32). */
static inline vf load_w(const char *p, const int elem) {
#if defined(__AVX512F__)
    if (elem == BF16)
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    if (elem == I8) return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    if (elem == BF16)
        return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    if (elem == I8) return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    if (elem == BF16) return (vf)(__builtin_convertvector(*(const vu16 *)p, vu32) << 16);
    if (elem == I8) return __builtin_convertvector(__builtin_convertvector(*(const vi8 *)p, vi32), vf);
#endif
    return *(const vf *)p;
}

/* VL unsigned bytes as 32-bit lanes. */
static inline vu32 widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vu32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vu8 *)p, vu32);
#endif
}

static inline vf u32_to_f32(vu32 v) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps((__m512i)v);
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps((__m256i)v);
#else
    return __builtin_convertvector((vi32)v, vf);
#endif
}

/* FP8 E4M3 (float8_e4m3fn) -> float32: its exponent and mantissa bits moved to float32's positions read as
   a float32 with bias 127; times 2^120 that is the value, subnormals included (exact). */
static inline vf load_fp8(const uint8_t *p) {
    const vu32 w = widen_u8(p);
    return (vf)(((w & 0x7F) << 20) | ((w & 0x80) << 24)) * 0x1p120f;
}

/* VL group scales or offsets, float32 or float16 (F16C's conversion, present on every AVX2 CPU). */
static inline vf load_group(const void *p, const int group_elem) {
    if (group_elem == F32) return *(const vf *)p;
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf out;
    for (int l = 0; l < VL; l++) out[l] = (float)((const _Float16 *)p)[l];
    return out;
#endif
}

/* Group g of panel `panel` of a Q4 or Q8 weight of K rows: PANEL scales s, then PANEL offsets o. */
static inline const char *group_at(const LinearWeight *lw, const int K, const int panel, const int g) {
    const size_t ge = lw->group_elem == F32 ? 4 : 2;
    return (const char *)lw->groups + ((size_t)panel * (K / lw->group) + (size_t)g) * 2 * PANEL * ge;
}

/* Vector v of a group's 2 * PANEL_VECS: s for v < PANEL_VECS, then o. */
static inline vf group_vec(const LinearWeight *lw, const char *gp, const int v) {
    return load_group(gp + (size_t)v * VL * (lw->group_elem == F32 ? 4 : 2), lw->group_elem);
}

/* Rows k .. of a block of kn rows from row k0 that share row k0 + k's group (its s and o) end here. */
static inline int group_end(const LinearWeight *lw, const int k0, const int k, const int kn) {
    const int end = ((k0 + k) / lw->group + 1) * lw->group - k0;
    return end < kn ? end : kn;
}

/* Rows k0 .. k0 + kn - 1 of panel `panel` of a weight linear.c does not read as it multiplies (FP8, Q4, Q8),
   as float32 [kn, PANEL] in dq: w = q * scale (FP8, per output) or w = s * q - o (Q4, Q8: s, o per output and
   group of lw->group rows), each weight rounded once, as the reference dequantises it. */
static void dequantize(const LinearWeight *lw, const int K, const int panel, const int k0, const int kn,
                       float *dq) {
    const size_t rb = row_bytes(lw->elem);
    const uint8_t *w = (const uint8_t *)lw->w + ((size_t)panel * K + k0) * rb;
    if (lw->elem == FP8) {
        for (int k = 0; k < kn; k++)
            for (int j = 0; j < PANEL_VECS; j++)
                *(vf *)(dq + (size_t)k * PANEL + j * VL) = load_fp8(w + (size_t)k * rb + j * VL);
        return;
    }
    for (int k = 0; k < kn;) {
        /* the rows of this block in one group share its s and o: loaded once */
        const int end = group_end(lw, k0, k, kn);
        const char *gp = group_at(lw, K, panel, (k0 + k) / lw->group);
        vf s[PANEL_VECS], o[PANEL_VECS];
        for (int j = 0; j < PANEL_VECS; j++) {
            s[j] = group_vec(lw, gp, j);
            o[j] = group_vec(lw, gp, PANEL_VECS + j);
        }
        for (; k < end; k++) {
            const uint8_t *row = w + (size_t)k * rb;
            float *out = dq + (size_t)k * PANEL;
            if (lw->elem == Q4) {
                /* one widened load gives a vector of the low half's columns and one of the high half's */
                for (int j = 0; j < PANEL_VECS / 2; j++) {
                    const vu32 b = widen_u8(row + j * VL);
                    const int hi = j + PANEL_VECS / 2;
                    *(vf *)(out + j * VL) = s[j] * u32_to_f32(b & 0xF) - o[j];
                    *(vf *)(out + hi * VL) = s[hi] * u32_to_f32(b >> 4) - o[hi];
                }
            } else {
                for (int j = 0; j < PANEL_VECS; j++)
                    *(vf *)(out + j * VL) = s[j] * load_w((const char *)row + j * VL, I8) - o[j];
            }
        }
    }
}

/* A weight vector held in a register for every row's FMA. Left to itself GCC folds the load into each
   FMA as a memory operand, so a tile of mr rows loads every weight vector mr times: with 8-float vectors,
   whose broadcasts of x are loads too, the loads then outnumber the FMAs and the load ports, not the FMA
   units, set the pace. IN_REGISTER=0 leaves the choice to the compiler. */
#ifndef IN_REGISTER
#define IN_REGISTER 1
#endif
static inline __attribute__((always_inline)) vf in_register(vf v) {
#if IN_REGISTER && (defined(__AVX2__) || defined(__AVX512F__))
    __asm__("" : "+x"(v));
#endif
    return v;
}

#if !GEMM_BLOCKED
/* One tile: mr x rows (stride K) against the cols <= TCOLS columns of a panel starting at w (panel row
   stride PANEL elements); writes (accumulate: adds to) y rows (stride N) from its first column. scale,
   bias: the tile's first column's, or NULL. pf: what to prefetch, row k at pf + k * the row stride. full:
   whether the panel has all PANEL columns; a partial one goes out a column at a time, as store_panel writes
   it (vector and scalar code may contract the scale and bias differently), so that a row's answer is the
   same whichever path computed it. */
static inline __attribute__((always_inline)) void tile(
    const float *x, const char *w, const char *pf, float *y, const int K, const int N, const int mr,
    const int nv, const int cols, const int full, const int elem, const float *scale, const float *bias,
    const int accumulate
) {
    const size_t stride = row_bytes(elem), es = stride / PANEL;
    /* The running totals, touched once a KBLOCK, live in memory: left to the register allocator, a 7-row
       tile's 14 accumulators, 14 totals, 2 weight vectors and a broadcast took 31 of AVX-512's 32
       registers, GCC kept the totals and spilled the weights, and every FMA read its weight from the
       stack at half the rate of 6 or 8 rows. */
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
            PREFETCH(pf + (size_t)k * stride);
            if (stride > 64) PREFETCH(pf + (size_t)k * stride + 64); /* float32: 2 lines a row */
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
        const float *s, const float *b, int acc                                                          \
    ) {                                                                                                  \
        tile(x, w, pf, y, K, N, (mr) < MR ? (mr) : MR, NV, cols, full, elem, s, b, acc);                 \
    }
#define TILES(elem)                                                                                    \
    TILE_FN(1, elem) TILE_FN(2, elem) TILE_FN(3, elem) TILE_FN(4, elem) TILE_FN(5, elem) TILE_FN(6, elem) \
        TILE_FN(7, elem) TILE_FN(8, elem) TILE_FN(9, elem) TILE_FN(10, elem) TILE_FN(11, elem) TILE_FN(12, elem)
TILES(0)
TILES(1)
TILES(2)

typedef void (*tile_fn)(
    const float *, const char *, const char *, float *, int, int, int, int, const float *, const float *, int
);
/* By element type (those tile() reads itself: F32, BF16, I8) and rows (1 .. 12, the largest MR). */
#define ROW(e) {tile_1_##e, tile_2_##e, tile_3_##e, tile_4_##e, tile_5_##e, tile_6_##e, tile_7_##e, tile_8_##e, \
                tile_9_##e, tile_10_##e, tile_11_##e, tile_12_##e}
static const tile_fn TILE_FNS[3][12] = {ROW(0), ROW(1), ROW(2)};
#ifdef WIDE_ROWS
#define WIDE_FN(mr, elem)                                                                                \
    static __attribute__((noinline)) void wide_##mr##_##elem(                                           \
        const float *x, const char *w, const char *pf, float *y, int K, int N, int cols, int full,        \
        const float *s, const float *b, int acc                                                          \
    ) {                                                                                                  \
        tile(x, w, pf, y, K, N, mr, PANEL_VECS, cols, full, elem, s, b, acc);                            \
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

#endif

/* Rows kn of one K block of a tile: mr x rows (stride K) against kn rows of a panel's nv vectors starting
   at w (row stride PANEL elements). The block's partial sums (mr rows of PANEL floats at part) start from
   zero when `first` and from part's otherwise; at the `last` rows of the block they are added to tot (same
   layout), else kept in part for the block's next rows, so a block gone through in pieces sums as one.
   npf <= 2 kn lines from pf are prefetched on the way. Only the first mx <= mr rows are x's: the tile's
   rows past them repeat row 0's products and are neither read from part nor written (paced tiles, see
   pace_rows). */
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
    const int kn, const int mr, const int mx, const int nv, const int elem, const int first, const int last
) {
    const size_t stride = row_bytes(elem), es = stride / PANEL;
    A_ROWS(A_ROW)
    A_ROWS(A_ROW_LOAD)
    /* The rows that prefetch two lines, then one, then none, as three loops: a test of k against npf at
       every row cost the tile's loop issue slots it has few of beside 12 FMAs and 8 loads. */
    const int n2 = npf > kn ? npf - kn : 0, n1 = npf < kn ? npf : kn;
    int k = 0;
    for (; k < n2; k++) {
        PREFETCH_NEAR_FAR(pf + (size_t)k * 64);
        PREFETCH_NEAR_FAR(pf + (size_t)(k + kn) * 64);
        KB_STEP
    }
    for (; k < n1; k++) {
        PREFETCH_NEAR_FAR(pf + (size_t)k * 64);
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
   every row (Q_FUSED_ROWS; two tiles of 3 rows measured slower than the buffer's one tile of 6).
   dq_vec is vector j of a panel row as dequantize computes it: Q4 packs columns c and c + PANEL / 2 in
   the low and high nibble of byte c. */
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
    const int kn, const int mr, const int mx, const int nv, const int elem, const int first, const int last
) {
#if VL == 8
    if (mr <= 6 && nv <= 4 && mr * nv <= 12) {
        kb_tile_named(x, w, pf, npf, tot, part, K, kn, mr, mx, nv, elem, first, last);
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
        if (k < npf) PREFETCH_NEAR_FAR(pf + (size_t)k * 64);
        if (k + kn < npf) PREFETCH_NEAR_FAR(pf + (size_t)(k + kn) * 64); /* a float32 block in one call */
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

#define KB_FN(mr, elem)                                                                                   \
    static __attribute__((noinline)) void kb_##mr##_##elem(const float *x, const char *w, const char *pf,  \
                                                           int npf, float *tot, float *part, int K, int kn, \
                                                           int mx, int first, int last) {                   \
        kb_tile(x, w, pf, npf, tot, part, K, kn, (mr) < MR ? (mr) : MR, mx, NV, elem, first, last);        \
    }
#define KBS(elem)                                                                                       \
    KB_FN(1, elem) KB_FN(2, elem) KB_FN(3, elem) KB_FN(4, elem) KB_FN(5, elem) KB_FN(6, elem) KB_FN(7, elem) \
        KB_FN(8, elem) KB_FN(9, elem) KB_FN(10, elem) KB_FN(11, elem) KB_FN(12, elem)
KBS(0)
KBS(1)
KBS(2)
typedef void (*kb_fn)(const float *, const char *, const char *, int, float *, float *, int, int, int, int,
                      int);
#define KROW(e) {kb_1_##e, kb_2_##e, kb_3_##e, kb_4_##e, kb_5_##e, kb_6_##e, kb_7_##e, kb_8_##e, kb_9_##e, \
                 kb_10_##e, kb_11_##e, kb_12_##e}
static const kb_fn KB_FNS[3][12] = {KROW(0), KROW(1), KROW(2)};
#ifdef WIDE_ROWS
#define KBW_FN(mr, elem)                                                                                  \
    static __attribute__((noinline)) void kbw_##mr##_##elem(const float *x, const char *w, const char *pf, \
                                                            int npf, float *tot, float *part, int K,       \
                                                            int kn, int mx, int first, int last) {          \
        kb_tile(x, w, pf, npf, tot, part, K, kn, mr, mx, PANEL_VECS, elem, first, last);                  \
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

/* The output of one panel's totals (M rows of PANEL floats): times the column scale, plus the bias, into y
   (or added to it). */
static void store_panel(const float *tot, const LinearWeight *lw, float *y, const int M, const int N,
                        const int n0, const int accumulate) {
    const int cols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *scale = lw->scale ? lw->scale + n0 : NULL, *bias = lw->bias ? lw->bias + n0 : NULL;
    for (int m = 0; m < M; m++) {
        float *out = y + (size_t)m * N + n0;
        const float *t = tot + (size_t)m * PANEL;
        if (cols == PANEL) {
            for (int j = 0; j < PANEL_VECS; j++) {
                vf v = *(const vf *)(t + j * VL);
                if (scale) v *= *(const vf *)(scale + j * VL);
                if (bias) v += *(const vf *)(bias + j * VL);
                if (accumulate) v += *(const vf *)(out + j * VL); /* a residual, added as torch's `h + y` */
                *(vf *)(out + j * VL) = v;
            }
        } else {
            for (int c = 0; c < cols; c++) {
                float s = t[c];
                if (scale) s *= scale[c];
                if (bias) s += bias[c];
                out[c] = accumulate ? out[c] + s : s;
            }
        }
    }
}

void batchq_linear_store_panel(const float *tot, const LinearWeight *lw, float *y, int M, int N, int n0,
                               int accumulate) {
    store_panel(tot, lw, y, M, N, n0, accumulate);
}

/* One x row against rows k0 .. k0 + kn - 1 of a Q4 or Q8 panel, the weights dequantised in registers (no
   trip through dq: at one row, the store and reload would cost as much as the product), the block's
   partial sums added to tot: what dequantize and a tile would compute, in the same order. */
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
   tile adds its partial sums over the block to the panel's totals, the sums tile() would form, in its order.
   The tiles of a block share out the prefetches of the weights ahead of it, so memory streams evenly
   however many tiles reread it. Weights linear.c does not read as it multiplies (FP8, Q4, Q8) are
   dequantised a block at a time into an L1 buffer first, once for all the tiles. */
static void linear_part_kb(const float *x, const LinearWeight *lw, float *y, const int M, const int K,
                           const int N, const int p0, const int p1, const int accumulate) {
    const int elem = lw->elem, direct = elem == F32 || elem == BF16 || elem == I8;
    const size_t rb = row_bytes(elem), panel_bytes = (size_t)K * rb;
    /* rows a tile call takes of a block (a dequantised block is in L1 already: whole), and how far ahead
       of its piece a call prefetches: at least the piece, or it would prefetch lines of the piece itself */
    const int sub = !direct || M >= KB_WHOLE * (int)(rb / PANEL) ? KBLOCK : KB_SUB;
    const size_t ahead = (size_t)sub * rb > PREFETCH_BYTES ? (size_t)sub * rb : PREFETCH_BYTES;
    int mr_max = MR, tcols = TCOLS;
    const kb_fn *fns = KB_FNS[direct ? elem : F32];
#ifdef WIDE_ROWS
    if (M <= wide_rows) mr_max = WIDE_MR, tcols = PANEL, fns = KBW_FNS[direct ? elem : F32];
#endif
    const int tiles = (M + mr_max - 1) / mr_max, halves = PANEL / tcols, calls = tiles * halves;
    const int paced = direct && tcols == TCOLS && M < pace_rows ? pace_rows : 0; /* then one tile of M rows */
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
                for (int l = 0; l < lines; l++) PREFETCH_NEAR_FAR(wk + PREFETCH_BYTES + (size_t)l * 64);
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
                dequantize(lw, K, p, k0, kn, dq);
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
                                                      part + at, K, sn, mr, first, last);
                    }
                }
            }
        }
        store_panel(tot, lw, y, M, N, p * PANEL, accumulate);
    }
}

/* Rows a tile takes at most in prompt-sized steps (M > KB_ROWS). With 16-float vectors, tiles of MR = 12
   rows serve decode steps best (the fewest rereads of panels streamed from memory), but prompt steps, which
   reread every panel from L2 anyway, run faster in 8-row ones (benchmarks/linear_ab.c at prompt sizes). */
#ifndef PROMPT_MR
#define PROMPT_MR (VL == 16 ? 8 : MR)
#endif
#if !GEMM_BLOCKED
/* Prompt-sized steps: each panel streamed once, x rows in tiles that reread it from L2. A weight linear.c
   does not read as it multiplies is dequantised a panel at a time into `dq` first (K x PANEL floats). */
static void linear_part_tiles(const float *x, const LinearWeight *lw, float *y, const int M, const int K,
                              const int N, const int p0, const int p1, const int accumulate, float *dq) {
    const int direct = lw->elem == F32 || lw->elem == BF16 || lw->elem == I8, elem = direct ? lw->elem : F32;
    const size_t panel_bytes = (size_t)K * row_bytes(lw->elem);
    int mr_max = M > KB_ROWS ? PROMPT_MR : MR, tcols = TCOLS;
    const tile_fn *fns = TILE_FNS[elem];
#ifdef WIDE_ROWS
    if (M <= wide_rows) mr_max = WIDE_MR, tcols = PANEL, fns = WIDE_FNS[elem];
#endif
    const int tiles = (M + mr_max - 1) / mr_max; /* of balanced sizes: 16 rows are 2 x 8, not 12 + 4 */
    for (int p = p0; p < p1; p++) {
        const char *wp = (const char *)lw->w + (size_t)p * panel_bytes;
        const int full = N - p * PANEL >= PANEL;
        if (!direct) {
            for (int k0 = 0; k0 < K; k0 += KBLOCK)
                dequantize(lw, K, p, k0, K - k0 < KBLOCK ? K - k0 : KBLOCK, dq + (size_t)k0 * PANEL);
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
                            lw->scale ? lw->scale + n0 : NULL, lw->bias ? lw->bias + n0 : NULL, accumulate);
            }
        }
    }
}

#endif

/* Prompt-sized steps, GEMM-blocked (GotoBLAS's loop order), where measured faster than the panel tiles above:
   with 8-float vectors. The panel tiles read a whole K of a half-panel per tile of rows, K x 64 bytes, which
   leaves L1 past K = 512 (and, with the x rows it meets, L2 past a few thousand): at a 7B model's K of
   4,096-14,336 their rate fell well below the FMA peak. Here K goes in chunks of GEMM_KC rows, so each
   chunk of a half-panel (16 KB of float32) stays in L1 while every tile of a chunk of GEMM_MC x rows rereads
   it, and that chunk of x stays in L2 while every panel of a group meets it. x is read where it lies (a
   tile's GMR row pointers, one broadcast each per k: GMR sequential streams), not packed first: packing
   buys one stream per tile, which the tiles do not need, and here each thread would repack all of x for
   every group of its panels (benchmarks/linear_ab.c's prompt steps measure the difference). Every output
   sums the same products in the same order as the other paths (KBLOCK blocks of FMAs, each added to a
   total that starts at zero), and goes out through store_panel as the decode-sized path's do, so a row's
   answer does not depend on the rows beside it. */
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

static int linear_part_gemm(const float *x, const LinearWeight *lw, float *y, const int M, const int K,
                            const int N, const int p0, const int p1, const int accumulate) {
    const int direct = lw->elem == F32 || lw->elem == BF16 || lw->elem == I8, elem = direct ? lw->elem : F32;
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
                        dequantize(lw, K, p, k0, kn, dq);
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
                    store_panel(tot + ((size_t)t * np + (p - g0)) * GMR * PANEL, lw, y + (size_t)(m0 + r0) * N,
                                mr, N, p * PANEL, accumulate);
            }
        }
    }
    return 0;
}
#endif

/* Thread t of nt's share of y = x W^T (+ bias) (y += ... with accumulate): a contiguous range of panels,
   each streamed once. Called inside a parallel region: by batchq_linear_w below, and by decode_stack.c for
   every linear layer of a decode step. Returns nonzero for a weight it cannot read. */
int batchq_linear_part_w(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int t, int nt,
                         int accumulate) {
    const int panels = (N + PANEL - 1) / PANEL;
    const int p0 = (int)((long)panels * t / nt), p1 = (int)((long)panels * (t + 1) / nt);
    if (lw->bf16_products) return batchq_linear_bf16dot_part(x, lw, y, M, K, N, p0, p1, accumulate);
    const int direct = lw->elem == F32 || lw->elem == BF16 || lw->elem == I8;
    if (M <= KB_ROWS && (!direct || KB_DIRECT)) {
        linear_part_kb(x, lw, y, M, K, N, p0, p1, accumulate);
        return 0;
    }
#if GEMM_BLOCKED
    return linear_part_gemm(x, lw, y, M, K, N, p0, p1, accumulate);
#else
    float *dq = NULL;
    if (!direct) {
        dq = (float *)aligned_alloc(64, (size_t)K * PANEL * sizeof(float));
        if (!dq) return 1;
    }
    linear_part_tiles(x, lw, y, M, K, N, p0, p1, accumulate, dq);
    free(dq);
    return 0;
#endif
}

/* Whether lw is a weight of K rows this library reads. */
static int valid(const LinearWeight *lw, const int K) {
    /* bf16 products pair rows 2k and 2k + 1, which must share a group */
    if (lw->bf16_products && (!batchq_linear_has_bf16dot() || ((lw->elem == Q4 || lw->elem == Q8) && lw->group % 2)))
        return 0;
    if (lw->elem < F32 || lw->elem > Q8 || K < 1) return 0;
    if (lw->elem == I8 || lw->elem == FP8) return lw->scale != NULL && lw->groups == NULL;
    if (lw->elem == Q4 || lw->elem == Q8)
        return lw->groups != NULL && lw->group > 0 && K % lw->group == 0 &&
               (lw->group_elem == F32 || lw->group_elem == F16);
    return 1;
}

int batchq_linear_w(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int threads) {
    if (!valid(lw, K)) return 1;
    const int nthreads = threads > 0 ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        failed |= batchq_linear_part_w(x, lw, y, M, K, N, omp_get_thread_num(), omp_get_num_threads(), 0);
#else
        failed |= batchq_linear_part_w(x, lw, y, M, K, N, 0, 1, 0);
#endif
    }
    return failed;
}

/* The float32 / bfloat16 / int8 weights of decode_stack.c's layers and of the first callers. */
void batchq_linear_part(const float *x, const void *w, const float *wscale, const float *bias, float *y, int M,
                        int K, int N, int elem, int t, int nt, int accumulate) {
    const LinearWeight lw = {w, wscale, NULL, bias, elem, 0, F32};
    batchq_linear_part_w(x, &lw, y, M, K, N, t, nt, accumulate);
}

int batchq_linear(const float *x, const void *w, const float *wscale, const float *bias, float *y, int M, int K,
                  int N, int elem, int threads) {
    if (elem < F32 || elem > I8) return 1;
    const LinearWeight lw = {w, wscale, NULL, bias, elem, 0, F32};
    return batchq_linear_w(x, &lw, y, M, K, N, threads);
}

/* The small per-token ops around the linear layers, one call each instead of a chain of torch ops (at
   decode sizes each torch op costs more in dispatch than in arithmetic: an RMSNorm was 8 ops).

   RMSNorm, Hugging Face's float32 formula: y = w * (x * 1/sqrt(mean(x^2) + eps)). x, y: [T, D] rows
   (y may be x). */
void batchq_rmsnorm_row(const float *x, const float *w, float *y, int D, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < D; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int i = 0; i < D; i++) y[i] = w[i] * (x[i] * r);
}

void batchq_rmsnorm(const float *x, const float *w, float *y, int T, int D, float eps) {
#pragma omp parallel for if ((long)T * D > (1L << 16)) schedule(static)
    for (int t = 0; t < T; t++) batchq_rmsnorm_row(x + (size_t)t * D, w, y + (size_t)t * D, D, eps);
}

/* The gated MLP's SiLU: act [T, I] = silu(gate) * up for rows gu [T, 2I] of gate then up (the fused
   gate_up projection's output), in one pass (torch's silu and multiply took three over a prompt step's
   tens of MB); cpu_math.h's silu_mul, as the decode stack computes it. */
void batchq_silu_mul(const float *gu, float *act, int T, int I) {
#pragma omp parallel for if ((long)T * I > (1L << 16)) schedule(static)
    for (int t = 0; t < T; t++) silu_mul(gu + (size_t)t * 2 * I, gu + (size_t)t * 2 * I + I, act + (size_t)t * I, I);
}

/* The same for Gemma's GELU (tanh_form: its tanh approximation, else the exact erf form): cpu_math.h's
   gelu_mul, as the decode stack computes it (torch's vectorised GELU takes another path for a tensor's
   tail than for its body, so a row's bits would follow the step's size). */
void batchq_gelu_mul(const float *gu, float *act, int T, int I, int tanh_form) {
#pragma omp parallel for if ((long)T * I > (1L << 16)) schedule(static)
    for (int t = 0; t < T; t++)
        gelu_mul(gu + (size_t)t * 2 * I, gu + (size_t)t * 2 * I + I, act + (size_t)t * I, I, tanh_form);
}

/* Rotary embedding in place, Hugging Face's rotate-half form: for i < D/2, with a = x[i], b = x[i + D/2],
   x[i] = a cos[i] - b sin[i] and x[i + D/2] = b cos[i + D/2] + a sin[i + D/2]. x: T rows of H heads of D
   floats (row stride, head stride in floats; the heads of a fused QKV output stay where they are);
   cos, sin: [T, D], each token's row. */
void batchq_rotary_head(float *v, const float *c, const float *s, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

void batchq_rotary(float *x, int T, int H, long row_stride, long head_stride, const float *cos, const float *sin,
                   int D) {
#pragma omp parallel for if ((long)T * H * D > (1L << 16)) schedule(static)
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++)
            batchq_rotary_head(x + (size_t)t * row_stride + (size_t)h * head_stride, cos + (size_t)t * D,
                               sin + (size_t)t * D, D);
}

/* The FMA peak of the instruction set this library was built for, for benchmarks: `iters` rounds of
   FMA_CHAINS independent vector FMAs on every thread (independent chains hide the FMA latency, as a
   GEMM tile's accumulators do). Returns the floats one round multiplies-and-adds (VL * FMA_CHAINS); the
   caller times the call and counts 2 * that * iters * threads FLOPs. sink receives a sum, so nothing is optimised away. */
#define FMA_CHAINS 12
int batchq_fma_probe(long iters, int threads, float *sink) {
    const int nthreads = threads > 0 ? threads : 1;
    float total = 0.0f;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        vf acc[FMA_CHAINS];
        const vf a = (vf){0} + 0.999999f, b = (vf){0} + 1e-7f;
        for (int c = 0; c < FMA_CHAINS; c++) acc[c] = (vf){0} + (float)c;
        for (long i = 0; i < iters; i++)
            for (int c = 0; c < FMA_CHAINS; c++) acc[c] = acc[c] * a + b;
        for (int c = 0; c < FMA_CHAINS; c++)
            for (int j = 0; j < VL; j++) total += acc[c][j];
    }
    *sink = total;
    return VL * FMA_CHAINS;
}
