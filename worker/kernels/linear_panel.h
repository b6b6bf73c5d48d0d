/* What the linear layers' files (linear.c, linear_dequant.c, linear_decode.c, linear_panels.c,
   linear_gemm.c) share: the packed panel's layout and the tiles' shapes for this instruction set, the
   vector loads that widen each weight type to float32, the prefetches, and the paths' entry points.

   The layout and PANEL are the same on every instruction set (only VL, MR and the number of tiles per
   panel differ), so a packed weight is valid wherever it is loaded. */
#ifndef BATCHQ_LINEAR_PANEL_H
#define BATCHQ_LINEAR_PANEL_H
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "linear.h"

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
   is small. Where one tile holds every row (M <= LinearTuning's wide_rows), a tile over the whole panel
   can stream it once with PANEL_VECS chains per row: WIDE_MR rows x PANEL_VECS vectors = 12 accumulators
   of the 16 registers. Which streams faster at 1-3 rows differs between CPUs, so it is the machine's
   choice (the tuning's wide_rows; 0, halves, by default). Every output sums the same products in the same
   order either way. With more rows the whole-panel tiles would each reread the panel, and the MR x NV
   tiles, which need fewer broadcasts per FMA, do better. */
#if TCOLS < PANEL
#ifndef WIDE_MR
#define WIDE_MR 3
#endif
#define WIDE_ROWS WIDE_MR /* the most rows whole-panel tiles can take */
#endif

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vu16 __attribute__((vector_size(VL * 2), aligned(2)));
typedef int8_t vi8 __attribute__((vector_size(VL), aligned(1)));
typedef uint8_t vu8 __attribute__((vector_size(VL), aligned(1)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
typedef int32_t vi32 __attribute__((vector_size(VL * 4)));

/* Bytes of one panel row (PANEL weights) by element type. Q4 packs two weights a byte: byte j of a row holds
   column j in its low nibble and column j + PANEL / 2 in its high one, so one widened load gives both halves
   of the panel row. */
static inline size_t row_bytes(const int elem) {
    return elem == F32 ? PANEL * 4 : elem == BF16 ? PANEL * 2 : elem == Q4 ? PANEL / 2 : PANEL;
}
/* Whether the tiles read this weight type as stored, widening it as they load (F32, BF16, I8); the others
   (FP8, Q4, Q8) are dequantised first (linear_dequant.c) or as they are read. */
static inline int read_direct(const int elem) { return elem == F32 || elem == BF16 || elem == I8; }

/* A panel is prefetched this far ahead of its loads: the hardware prefetchers alone keep too few lines in
   flight once a tile has several x rows of work per weight. It covers DRAM latency at one core's share of
   the bandwidth. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
/* The prefetches' hint, t0 (the tuning's prefetch_t0): non-temporal (prefetchnta: the weights, streamed
   once a step, evict little else) or into every level (prefetcht0). Which streams faster is the machine's:
   on some CPUs the non-temporal prefetches leave the weights streaming far slower, on others the hint
   makes no difference. The branch is taken the same way all along, and the hint changes when lines
   arrive, never a result. */
#define PREFETCH(t0, p)                                     \
    do {                                                    \
        if (t0) __builtin_prefetch((p), 0, 3);              \
        else __builtin_prefetch((p), 0, 0);                 \
    } while (0)
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

/* Prompt-sized steps (M > KB_ROWS) with 8-float vectors take the GEMM-blocked path (linear_part_gemm); with
   16-float ones the panel tiles (linear_part_tiles), which also run AVX-512's decode-sized steps. */
#ifndef GEMM_BLOCKED
#define GEMM_BLOCKED (VL == 8)
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

/* The paths, each for panels p0 .. p1 - 1 of one thread's share (batchq_linear_part_w chooses; tn: the
   tuning in force, clamped to this build's knobs), and the dequantisation and store they share. Hidden:
   called across the linear files, not exported from the library. */
#define LINEAR_HIDDEN __attribute__((visibility("hidden")))
/* linear_dequant.c */
LINEAR_HIDDEN void linear_dequantize(const LinearWeight *lw, int K, int panel, int k0, int kn, float *dq);
LINEAR_HIDDEN void linear_store_panel(const float *tot, const LinearWeight *lw, float *y, int M, int N, int n0,
                                      int accumulate);
/* linear_decode.c: decode-sized steps a K block at a time (M <= KB_ROWS) */
LINEAR_HIDDEN void linear_part_kb(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int p0,
                                  int p1, int accumulate, const LinearTuning *tn);
#if GEMM_BLOCKED
/* linear_gemm.c: prompt-sized steps GEMM-blocked; nonzero where its scratch could not be allocated */
LINEAR_HIDDEN int linear_part_gemm(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int p0,
                                   int p1, int accumulate);
#else
/* linear_panels.c: a panel at a time, x rows in tiles (dq: K x PANEL floats for a dequantised panel) */
LINEAR_HIDDEN void linear_part_tiles(const float *x, const LinearWeight *lw, float *y, int M, int K, int N,
                                     int p0, int p1, int accumulate, float *dq, const LinearTuning *tn);
#endif

#endif
