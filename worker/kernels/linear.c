/* y = x W^T (+ bias) for the CPU at decode sizes: each weight row streamed from memory once per call.

   Built and loaded by worker/kernels/native.py (cc -O3 -march=native -fopenmp), like paged_decode.c.

   x: [M, K] float32 (rows contiguous); W: [N, K] in nn.Linear's layout (row n = output n), float32,
   bfloat16, or int8 with a float32 scale per output row (wscale); bias: [N] float32 or NULL;
   y: [M, N] float32. K must be a multiple of 16 (native.py checks).

   Why not torch: at the row counts of decode steps (1-64) MKL's sgemm runs far below the machine's
   memory bandwidth, and worse on AMD than on Intel (issue #21's table: the 576 x 49,152 LM head at
   M = 8 takes 50 ms on a Zen 3 EPYC where streaming its 113 MB once takes 3.4-4.7 ms).

   How: every output y[m, n] is a dot product of x row m and W row n, accumulated in vectors along K
   and reduced once at the end. Threads (torch's OpenMP pool) split the N rows of W into contiguous
   ranges. A thread walks its range in blocks of W rows small enough to stay in L2 (WBLOCK_BYTES) and,
   for each block, every tile of MR x rows against NR W rows: a block is read from memory once and from
   L2 for the other tiles, and the MR x NR accumulators stay in registers. float32 accumulation for
   every weight type; bfloat16 and int8 rows are widened as they are read (int8 times its row's scale
   after the sum). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define VL 16 /* floats per vector register */
#ifndef MR
#define MR 4 /* x rows per tile */
#endif
#ifndef NR
#define NR 4 /* W rows per tile: MR * NR accumulators + NR weights + 1 x vector <= 32 registers */
#endif
#else
#define VL 8
#ifndef MR
#define MR 4
#endif
#ifndef NR
#define NR 3 /* 12 accumulators + 3 weights + 1 x vector <= 16 registers */
#endif
#endif

typedef float vf __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vu16 __attribute__((vector_size(VL * 2), aligned(2)));
typedef int8_t vi8 __attribute__((vector_size(VL), aligned(1)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
typedef int32_t vi32 __attribute__((vector_size(VL * 4)));

enum { F32 = 0, BF16 = 1, I8 = 2 }; /* the weight's element type */

static const int ELEM_BYTES[] = {4, 2, 1};
#define WBLOCK_BYTES (96 * 1024)
/* Each W row is prefetched this far ahead of its loads. Without it, the hardware prefetchers kept too
   few lines in flight once a tile had 2-8 x rows of work per weight: 2 Zen 5 cores, the 576 x 49,152
   LM head at 4 rows, 2.7 ms with it, 3.4 ms without (1.9 ms streams the weight once). */
#define PREFETCH_BYTES 512

/* VL weights widened to float32. The widenings are intrinsics on x86: GCC 12 turns the generic
   __builtin_convertvector of int8 lanes into scalar inserts (int8 weights ran 2x slower than float32). */
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

/* The sum of a vector's lanes by halving (log2(VL) shuffles and adds, not VL scalar adds). */
static inline float hsum(vf v) {
#if VL == 16
    typedef float v8f __attribute__((vector_size(32)));
    v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    typedef float v8f __attribute__((vector_size(32)));
    v8f h = v;
#endif
    typedef float v4f __attribute__((vector_size(16)));
    v4f q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    q += __builtin_shufflevector(q, q, 2, 3, 0, 1);
    return q[0] + q[1];
}

/* One mr x nr tile over all of K: mr x rows from x (stride K), nr W rows from w (stride K elements). */
static inline __attribute__((always_inline)) void tile(
    const float *x, const char *w, float *y, const int K, const int N, const int mr, const int nr,
    const int elem, const float *wscale, const float *bias, const int accumulate
) {
    const size_t wrow = (size_t)K * ELEM_BYTES[elem];
    vf acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
    for (int k = 0; k < K; k += VL) {
        vf wv[NR];
        for (int j = 0; j < nr; j++) {
            const char *p = w + j * wrow + (size_t)k * ELEM_BYTES[elem];
            __builtin_prefetch(p + PREFETCH_BYTES, 0, 0);
            wv[j] = load_w(p, elem);
        }
        for (int i = 0; i < mr; i++) {
            const vf xv = *(const vf *)(x + (size_t)i * K + k);
            for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = hsum(acc[i][j]);
            if (wscale) s *= wscale[j];
            if (bias) s += bias[j];
            float *out = y + (size_t)i * N + j;
            *out = accumulate ? *out + s : s; /* accumulate: a residual added as torch's `h + y` would */
        }
}

/* Constant mr, nr and elem per call site, so each specialisation keeps its accumulators in registers. */
#define TILE_NR(mr, elem)                                                                              \
    static __attribute__((noinline)) void tile_##mr##_##elem(                                         \
        const float *x, const char *w, float *y, int K, int N, int nr, const float *s, const float *b, \
        int acc                                                                                        \
    ) {                                                                                                \
        switch (nr) {                                                                                  \
        case 1: tile(x, w, y, K, N, MRC(mr), 1, elem, s, b, acc); break;                               \
        case 2: tile(x, w, y, K, N, MRC(mr), 2, elem, s, b, acc); break;                               \
        case 3: tile(x, w, y, K, N, MRC(mr), 3 < NR ? 3 : NR, elem, s, b, acc); break;                 \
        case 4: tile(x, w, y, K, N, MRC(mr), 4 < NR ? 4 : NR, elem, s, b, acc); break;                 \
        default: tile(x, w, y, K, N, MRC(mr), NR, elem, s, b, acc); break;                             \
        }                                                                                              \
    }

#define MRC(mr) ((mr) < MR ? (mr) : MR)
#define TILES(elem)                                                                                    \
    TILE_NR(1, elem) TILE_NR(2, elem) TILE_NR(3, elem) TILE_NR(4, elem) TILE_NR(5, elem) TILE_NR(6, elem)   \
        TILE_NR(7, elem) TILE_NR(8, elem)
TILES(0)
TILES(1)
TILES(2)

typedef void (*tile_fn)(const float *, const char *, float *, int, int, int, const float *, const float *, int);
static const tile_fn TILE_FNS[3][8] = {
    {tile_1_0, tile_2_0, tile_3_0, tile_4_0, tile_5_0, tile_6_0, tile_7_0, tile_8_0},
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1},
    {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2, tile_7_2, tile_8_2},
};

/* Thread t of nt's share of y = x W^T (+ bias) (y += ... with accumulate): contiguous ranges of whole
   NR-row groups of W, so every thread streams its own part of the weight. Called inside a parallel
   region: by batchq_linear below, and by decode_stack.c for every linear layer of a decode step. */
void batchq_linear_part(
    const float *x, const void *w, const float *wscale, const float *bias, float *y, int M, int K, int N,
    int elem, int t, int nt, int accumulate
) {
    const size_t wrow = (size_t)K * ELEM_BYTES[elem];
    int block = (int)(WBLOCK_BYTES / wrow);
    block = block < NR ? NR : block - block % NR;
    const int groups = (N + NR - 1) / NR;
    const int g0 = (int)((long)groups * t / nt), g1 = (int)((long)groups * (t + 1) / nt);
    const int n_begin = g0 * NR, n_end = g1 * NR < N ? g1 * NR : N;
    for (int b0 = n_begin; b0 < n_end; b0 += block) {
        const int b1 = b0 + block < n_end ? b0 + block : n_end;
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? M - m0 : MR;
            const tile_fn fn = TILE_FNS[elem][mr - 1];
            for (int n0 = b0; n0 < b1; n0 += NR) {
                const int nr = b1 - n0 < NR ? b1 - n0 : NR;
                fn(x + (size_t)m0 * K, (const char *)w + (size_t)n0 * wrow, y + (size_t)m0 * N + n0, K, N, nr,
                   wscale ? wscale + n0 : NULL, bias ? bias + n0 : NULL, accumulate);
            }
        }
    }
}

int batchq_linear(
    const float *x, const void *w, const float *wscale, const float *bias, float *y, int M, int K, int N,
    int elem, int threads
) {
    if (K % VL != 0 || elem < 0 || elem > 2) return 1;
    const int nthreads = threads > 0 ? threads : 1;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        extern int omp_get_num_threads(void);
        batchq_linear_part(x, w, wscale, bias, y, M, K, N, elem, omp_get_thread_num(), omp_get_num_threads(), 0);
#else
        batchq_linear_part(x, w, wscale, bias, y, M, K, N, elem, 0, 1, 0);
#endif
    }
    return 0;
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
