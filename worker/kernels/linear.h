/* The linear layers' interface (linear.c and the linear_*.c files beside it), shared with decode_stack.c and
   moe.c: the weight's description, the tuning every call takes, and the entry points they call. */
#ifndef BATCHQ_LINEAR_H
#define BATCHQ_LINEAR_H

/* The weight's element type (native_linear.WEIGHT_TYPES). F32, BF16, I8 and FP8 are w itself (I8 and FP8
   times a float32 scale per output); Q4 (unsigned 4-bit) and Q8 (signed 8-bit) are quantised in groups of
   `group` rows of K, each output's weight w = s * q - o with s, o per group and output. */
enum { F32 = 0, BF16 = 1, I8 = 2, FP8 = 3, Q4 = 4, Q8 = 5 };
enum { F16 = 1 }; /* group_elem: the groups' float type, F32 or F16 */

typedef struct {
    const void *w;       /* packed panels [ceil(N / PANEL), K, PANEL] of elem (Q4: PANEL / 2 bytes a row) */
    const float *scale;  /* [N]: I8 and FP8 weights, else NULL */
    const void *groups;  /* Q4, Q8: [ceil(N / PANEL), K / group, 2, PANEL] of group_elem, s then o; else NULL */
    const float *bias;   /* [N] or NULL */
    int elem;
    int group;           /* K rows per group (Q4, Q8) */
    int group_elem;
    /* 0: float32 products (the weight widened); 1: bfloat16 products, x and the weight rounded to bf16 and
       multiplied by VDPBF16PS (linear_bf16dot.c; AVX-512 BF16 builds only) */
    int bf16_products;
} LinearWeight;

/* How the kernels stream the weights on this machine: which of two ways is faster differs between CPUs, so
   each knob is measured once per machine (native_linear.measure_tuning) and passed to every call. No knob
   changes an answer: every output sums the same products in the same order whatever the tuning. NULL, or
   all zeros, is the default; a knob this build lacks (batchq_linear_tunable) is ignored, and a row count
   beyond the tiles it has is clamped to them. */
typedef struct LinearTuning {
    int prefetch_t0;  /* 1: prefetch weights into every cache level (prefetcht0); 0: non-temporally */
    int far_prefetch; /* 1: decode-sized steps also prefetch each line far ahead into L2 */
    int wide_rows;    /* decode-sized steps of up to this many rows take whole-panel tiles (0 .. WIDE_ROWS) */
    int pace_rows;    /* decode-sized steps of fewer rows run through tiles of this many (0: off; 2 .. MR) */
} LinearTuning;

/* batchq_linear_tunable's bits: bit i is LinearTuning's field i. */
enum { TUNE_PREFETCH_T0 = 1, TUNE_FAR_PREFETCH = 2, TUNE_WIDE_ROWS = 4, TUNE_PACE_ROWS = 8 };

/* linear.c: thread t of nt's share of y = x W^T (+ bias) (y += ... with accumulate), called inside a
   parallel region (by batchq_linear_w, decode_stack.c and moe.c); nonzero for a weight it cannot read. */
int batchq_linear_part_w(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int t, int nt,
                         int accumulate, const LinearTuning *tuning);
/* linear_bf16dot.c: panels p0 .. p1 - 1 of y = x W^T (* scale) (+ bias) in bfloat16 products; nonzero where
   the build has no VDPBF16PS or scratch could not be allocated. */
int batchq_linear_bf16dot_part(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int p0,
                               int p1, int accumulate);
int batchq_linear_has_bf16dot(void);
/* linear_dequant.c: a panel's sums (M rows of PANEL floats) times the scale per output, plus the bias, into
   y's columns n0 .. (or added to them with accumulate): how every path stores. */
void batchq_linear_store_panel(const float *tot, const LinearWeight *lw, float *y, int M, int N, int n0,
                               int accumulate);

#endif
