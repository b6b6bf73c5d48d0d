/* y = x W^T (+ bias) for the CPU: the linear layers of every step, decode-sized or prompt-sized; and the
   small per-token ops around them (RMSNorm, the gated MLP's activation, rotary rows).

   Built by worker/kernels/native_build.py (cc -O3 -march=native -fopenmp) from this file and the others of
   native_linear.SOURCES, bound by native_linear.py, and linked into decode_stack.c's and moe.c's libraries:
     linear.c           the entry points: which path a step takes, the tuning in force, the small ops
     linear_panel.h     the packed layout, the tiles' shapes, the widening loads, the prefetches
     linear_dequant.c   FP8, Q4 and Q8 weights made float32, and the store every path ends with
     linear_decode.c    decode-sized steps (M <= KB_ROWS) a K block at a time
     linear_panels.c    the panel tiles: 16-float vectors' other steps
     linear_gemm.c      prompt-sized steps GEMM-blocked (8-float vectors)
     linear_bf16dot.c   bfloat16 products (AVX-512 BF16)

   x: [M, K] float32 (rows contiguous); bias: [N] float32 or NULL; y: [M, N] float32. W, the [N, K]
   weight of nn.Linear, is stored packed in panels of PANEL output columns (native_linear.pack): panel p
   holds columns p*PANEL .. p*PANEL+PANEL-1 as K rows of PANEL contiguous elements, [ceil(N/PANEL), K,
   PANEL], the last panel zero-padded; float32, bfloat16, or int8 with a float32 scale per output (wscale);
   linear.h's LinearWeight describes the other types.

   Why not torch: at the row counts of decode steps (1-64) MKL's sgemm runs far below the machine's memory
   bandwidth (issue #21), and at prompt sizes these kernels outrun its float32 rate on some CPUs too
   (`python benchmarks/kernel_bench.py --linear` measures both against the bounds).

   How (the register-tiled outer product of GEMM kernels): a tile is MR rows of x against NV vectors of
   VL output columns. For each k it loads the NV weight vectors of panel row k (widening bfloat16 and
   int8 to float32) and, for each x row, multiplies them by x[m, k] broadcast (AVX-512 folds the
   broadcast into the FMA), so MR x NV accumulators stay in registers, need no horizontal sums, and hold
   finished outputs at the end. A panel is one contiguous stream: threads (torch's OpenMP pool) take
   contiguous ranges of panels, and each streams its weights from memory once per call; further tiles of
   x rows read the panel again from L2. float32 accumulation for every weight type (int8 times its
   column's scale after the sum). Decode-sized steps go through each panel a K block at a time
   (linear_part_kb); prompt-sized ones, with 8-float vectors, through chunks of rows, K and panels sized for
   L1 and L2 (linear_part_gemm); with 16-float vectors the panel tiles take the rest (linear_part_tiles).
   Every path sums each output's products in the same order, so a row's answer does not depend on the
   rows beside it, nor on the tuning (linear.h's LinearTuning), which changes only how fast it comes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_math.h"
#include "linear_panel.h"

/* The tuning this build applies: NULL is the default (all off); a knob this build lacks is off, and a row
   count past the tiles it has is clamped to them (wide_rows to WIDE_ROWS; pace_rows to MR, and below 2,
   which paces nothing, to 0), so that any LinearTuning is safe to pass. */
static LinearTuning in_force(const LinearTuning *tuning) {
    LinearTuning t = {0, 0, 0, 0};
    if (!tuning) return t;
    t.prefetch_t0 = tuning->prefetch_t0 != 0;
#if KB_DIRECT
    t.far_prefetch = tuning->far_prefetch != 0;
    t.pace_rows = tuning->pace_rows < 2 ? 0 : tuning->pace_rows > MR ? MR : tuning->pace_rows;
#endif
#ifdef WIDE_ROWS
    t.wide_rows = tuning->wide_rows < 0 ? 0 : tuning->wide_rows > WIDE_ROWS ? WIDE_ROWS : tuning->wide_rows;
#endif
    return t;
}

/* Which of LinearTuning's knobs this build can change (TUNE_* bits): the prefetch hint always; the far
   prefetch and paced tiles where decode steps of every weight type take the K-block tiles (KB_DIRECT:
   8-float vectors); whole-panel tiles where a tile covers half a panel. */
int batchq_linear_tunable(void) {
    int bits = TUNE_PREFETCH_T0;
#if KB_DIRECT
    bits |= TUNE_FAR_PREFETCH | TUNE_PACE_ROWS;
#endif
#ifdef WIDE_ROWS
    bits |= TUNE_WIDE_ROWS;
#endif
    return bits;
}

/* Thread t of nt's share of y = x W^T (+ bias) (y += ... with accumulate): a contiguous range of panels,
   each streamed once. Called inside a parallel region: by batchq_linear_w below, by decode_stack.c for
   every linear layer of a decode step and by moe.c for every expert. Returns nonzero for a weight it
   cannot read. */
int batchq_linear_part_w(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int t, int nt,
                         int accumulate, const LinearTuning *tuning) {
    const int panels = (N + PANEL - 1) / PANEL;
    const int p0 = (int)((long)panels * t / nt), p1 = (int)((long)panels * (t + 1) / nt);
    if (lw->bf16_products) return batchq_linear_bf16dot_part(x, lw, y, M, K, N, p0, p1, accumulate);
    const int direct = read_direct(lw->elem);
    const LinearTuning tn = in_force(tuning);
    if (M <= KB_ROWS && (!direct || KB_DIRECT)) {
        linear_part_kb(x, lw, y, M, K, N, p0, p1, accumulate, &tn);
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
    linear_part_tiles(x, lw, y, M, K, N, p0, p1, accumulate, dq, &tn);
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

int batchq_linear_w(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int threads,
                    const LinearTuning *tuning) {
    if (!valid(lw, K)) return 1;
    const int nthreads = threads > 0 ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        failed |= batchq_linear_part_w(x, lw, y, M, K, N, omp_get_thread_num(), omp_get_num_threads(), 0, tuning);
#else
        failed |= batchq_linear_part_w(x, lw, y, M, K, N, 0, 1, 0, tuning);
#endif
    }
    return failed;
}

/* A float32, bfloat16 or int8 weight (elem), its scale per output (int8) and bias given apart. */
int batchq_linear(const float *x, const void *w, const float *wscale, const float *bias, float *y, int M, int K,
                  int N, int elem, int threads, const LinearTuning *tuning) {
    if (elem < F32 || elem > I8) return 1;
    const LinearWeight lw = {w, wscale, NULL, bias, elem, 0, F32};
    return batchq_linear_w(x, &lw, y, M, K, N, threads, tuning);
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
